"""Environment of the vLLM engines that tests start (offline, small KV cache, no telemetry)."""

ENGINE_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tests cap blocks lower still
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Two or three engines share the machine's cores: one OpenMP thread each (more threads than
    # cores spin at every barrier; worker.engines.vllm.agents.engine_environment).
    "OMP_NUM_THREADS": "1",
}
