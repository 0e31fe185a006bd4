"""The host target's worker: vLLM's CPU worker running our model runner."""

from __future__ import annotations

import contextlib

import vllm.v1.worker.cpu_worker as cpu_worker_module
from vllm.v1.worker.cpu_worker import CPUWorker

from ascend_core.config import init_ascend_config
from ascend_core.worker.host_model_runner import AscendHostModelRunner


@contextlib.contextmanager
def _model_runner_class(runner_cls):
    # CPUWorker.init_device builds its runner from the module-level name
    # CPUModelRunner after binding threads and setting up distributed state;
    # swapping that name for the duration of the call reuses all of it.
    original = cpu_worker_module.CPUModelRunner
    cpu_worker_module.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker_module.CPUModelRunner = original


class AscendHostWorker(CPUWorker):
    def __init__(self, vllm_config, *args, **kwargs):
        # Workers run in their own processes: parse additional_config here too.
        init_ascend_config(vllm_config.additional_config, target="host")
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self):
        # Model Runner V2 is vLLM's own and is left as it is.
        if self.use_v2_model_runner:
            return super().init_device()
        with _model_runner_class(AscendHostModelRunner):
            return super().init_device()
