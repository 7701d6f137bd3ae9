"""Which exceptions are the client's fault (4xx) and which are the server's (5xx)."""

from __future__ import annotations

from http import HTTPStatus

from vllm_omni.entrypoints.openai.serving_base import error_status
from vllm_omni.errors import StageError


def test_validation_is_a_400_and_a_bug_is_a_500():
    assert error_status(ValueError("bad size"))[:2] == (HTTPStatus.BAD_REQUEST, "bad size")
    status, message, _ = error_status(TypeError("unsupported operand"))
    assert status == HTTPStatus.INTERNAL_SERVER_ERROR and "TypeError" in message
    status, message, _ = error_status(StageError("dit", TypeError("oops")))
    assert status == HTTPStatus.INTERNAL_SERVER_ERROR and message.startswith("stage 'dit'")
