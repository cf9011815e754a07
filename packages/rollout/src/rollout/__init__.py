"""rollout: generation backends (torch, vLLM), weight refit, prompt datasets and reward environments.

Nothing is imported here on purpose: reward worker subprocesses import `rollout._reward_worker` and
must not pay for torch. Import the parts directly:
`rollout.torch_backend.TorchGenerationBackend`, `rollout.vllm_backend.VLLMGenerationBackend`,
`rollout.environments.create_environment`, `rollout.datasets.load_prompt_dataset`.
"""

