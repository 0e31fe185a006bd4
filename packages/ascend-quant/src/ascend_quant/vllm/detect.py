"""Selecting the ``ascend`` method for an msModelSlim folder without ``--quantization``.

vLLM picks a checkpoint's method from ``config.json``'s ``quantization_config``; an
msModelSlim folder may carry only ``quant_model_description.json``. vLLM builds the
quantization config before the platform's ``check_and_update_config`` runs, so the
platform hook calls :func:`select_checkpoint_quantization`, which sets the method and
rebuilds the config. A method the user chose is kept (with a warning if it disagrees).
"""

from __future__ import annotations

import logging
import os

from ascend_quant.formats.modelslim import DESCRIPTION_FILE

logger = logging.getLogger(__name__)


def detect_method(model: str) -> str | None:
    """``"ascend"`` for a local folder holding an msModelSlim description, else None."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, DESCRIPTION_FILE)):
        return "ascend"
    return None


def select_checkpoint_quantization(vllm_config) -> str | None:
    """Set ``model_config.quantization`` (and ``vllm_config.quant_config``) for an
    msModelSlim checkpoint; returns the method now in use, or None."""
    model_config = vllm_config.model_config
    if model_config is None:
        return None
    detected = detect_method(model_config.model)
    chosen = model_config.quantization
    if detected is None:
        return chosen
    if chosen is not None:
        if chosen != detected:
            logger.warning("%s holds %s (msModelSlim) but quantization=%r was given; "
                           "keeping %r", model_config.model, DESCRIPTION_FILE, chosen, chosen)
        return chosen
    from vllm.config import VllmConfig

    model_config.quantization = detected
    vllm_config.quant_config = VllmConfig._get_quantization_config(
        model_config, vllm_config.load_config)
    logger.info("%s: msModelSlim checkpoint detected (%s); serving with quantization=%r",
                model_config.model, DESCRIPTION_FILE, detected)
    return detected
