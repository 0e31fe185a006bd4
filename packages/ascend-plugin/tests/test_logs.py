"""The packages' log records reach the handlers vLLM's logger has when they are emitted."""

import logging

import pytest

from ascend_plugin.logs import PACKAGE_LOGGERS, ToVllmHandlers, share_vllm_log_handlers


class Collect(logging.Handler):
    def __init__(self, level=logging.NOTSET):
        super().__init__(level)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    names = ("vllm", *PACKAGE_LOGGERS)
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level,
                 logging.getLogger(n).propagate) for n in names}
    for name in names:
        # As before any share; propagating, so pytest attaches no capture handlers to them
        # (it does to loggers that do not propagate).
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [], True
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers, logger.level, logger.propagate = handlers, level, propagate


def test_handlers_vllm_gets_after_the_plugins_load_receive_our_records(loggers):
    share_vllm_log_handlers()  # vLLM has no handler yet (an LLM's own process)
    vllm_logger = logging.getLogger("vllm")
    collect, warnings_only = Collect(), Collect(logging.WARNING)
    vllm_logger.handlers = [collect, warnings_only]  # vLLM configures its logging now
    vllm_logger.setLevel(logging.INFO)
    logging.getLogger("ascend_eplb.runtime").info("EPLB rearrangement %d", 1)
    logging.getLogger("ascend_core.config").debug("below vLLM's level")
    logging.getLogger("ascend_specdec").warning("drafts")
    assert collect.messages == ["EPLB rearrangement 1", "drafts"]
    assert warnings_only.messages == ["drafts"]


def test_a_logger_the_user_configured_is_left_alone(loggers):
    own = Collect()
    logging.getLogger("ascend_quant").addHandler(own)
    share_vllm_log_handlers()
    share_vllm_log_handlers()  # a second call adds nothing
    assert logging.getLogger("ascend_quant").handlers == [own]
    handlers = logging.getLogger("ascend_core").handlers
    assert len(handlers) == 1 and isinstance(handlers[0], ToVllmHandlers)
