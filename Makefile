# The two commands of the README. Each installs what it needs first (scripts/bootstrap.sh).
# `make test` runs the fast suite, then the real-model tier (SmolLM2-135M-Instruct, materialised once by
# `rlhfkit fetch` into ~/.cache/rlhfkit/models); `make test-fast` / `make test-real` run one of them.
.PHONY: demo test test-fast test-real install

PYTEST = .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15

install:
	./scripts/bootstrap.sh

demo: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} .venv/bin/rlhfkit demo --output runs/demo

test: test-fast test-real

test-fast: install
	$(PYTEST) -m "not real" $(PYTEST_ARGS)

test-real: install
	$(PYTEST) -m real tests/real $(PYTEST_ARGS)
