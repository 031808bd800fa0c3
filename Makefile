# The two commands of the README. Each installs what it needs first (scripts/bootstrap.sh).
.PHONY: demo test install

install:
	./scripts/bootstrap.sh

demo: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} .venv/bin/rlhfkit demo --output runs/demo

test: install
	.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
