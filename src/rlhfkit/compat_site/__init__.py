"""A folder put first on PYTHONPATH for the processes a vLLM server spawns (`rlhfkit vllm-serve`): its
`sitecustomize` runs rlhfkit's guard against vision/audio builds for another torch (rlhfkit/compat.py) as each of
them starts, since a spawned process begins with none of its parent's modules."""
