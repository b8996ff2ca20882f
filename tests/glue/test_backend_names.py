"""Our backend names pass vLLM's own validation (KernelConfig, EngineArgs, the CLI parser); unknown names do not."""

from __future__ import annotations

import typing
from typing import Literal, Optional

import pytest
from pydantic import ValidationError
from vllm.config.kernel import KernelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_nvfp4_sm120.vllm import backend_names
from vllm_nvfp4_sm120.vllm.linear import BACKEND_NAMES

from vllm_platform import cpu_platform

UNKNOWN = ["nvfp4_sm120_bogus", "nvfp4-sm121", "sm_120x"]


@pytest.fixture(scope="module")
def parser(registered):
    """vLLM's CLI parser, built after the plugin registered (as ``vllm serve`` does)."""
    with pytest.MonkeyPatch.context() as mp:
        cpu_platform(mp)  # EngineArgs' CLI defaults infer the device type
        yield EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_kernel_config_accepts(registered, name):
    assert KernelConfig(linear_backend=name).linear_backend == name
    assert KernelConfig(linear_backend=name.replace("_", "-").upper()).linear_backend == name
    per_quant = {"nvfp4_w4a4": name, "nvfp4_w4a16": name}
    assert KernelConfig(linear_backend_per_quant=per_quant).linear_backend_per_quant == per_quant


@pytest.mark.parametrize("name", UNKNOWN)
def test_kernel_config_rejects_unknown(registered, name):
    with pytest.raises(ValidationError):
        KernelConfig(linear_backend=name)
    with pytest.raises(ValidationError):
        KernelConfig(linear_backend_per_quant={"nvfp4_w4a4": name})


def test_vllm_names_still_accepted(registered):
    for name in ("auto", "marlin", "flashinfer_b12x", "emulation"):
        assert KernelConfig(linear_backend=name).linear_backend == name


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_cli_accepts(parser, name):
    args = parser.parse_args(["--linear-backend", name.replace("_", "-")])
    assert args.linear_backend == name
    assert EngineArgs.from_cli_args(args).linear_backend == name


@pytest.mark.parametrize("name", UNKNOWN)
def test_cli_rejects_unknown(parser, name, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--linear-backend", name])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_help_lists_names(parser):
    action = next(a for a in parser._actions if "--linear-backend" in a.option_strings)
    assert set(BACKEND_NAMES) <= set(action.choices)


L3 = Literal["a", "b", "c"]


@pytest.mark.parametrize(
    "tp, expected",
    [
        (Literal["a", "b"], L3),
        (dict[str, Literal["a", "b"]] | None, dict[str, L3] | None),
        (Optional[Literal["b", "a"]], Optional[L3]),
        (typing.Dict[str, Literal["a", "b"]], typing.Dict[str, L3]),
        (int | None, int | None),
        (Literal["a"], Literal["a"]),
    ],
)
def test_substitute(tp, expected):
    got = backend_names.substitute(tp, Literal["a", "b"], L3)
    assert got == expected


def test_moe_literal_extends_and_restores(registered):
    """The same machinery serves ``--moe-backend`` (for the MoE glue).

    ``restore`` undoes every extension of the Literal, the plugin's own included, so the plugin is taken off
    first and put back at the end.
    """
    registered.unregister()
    try:
        _extend_and_restore_moe_literal()
    finally:
        registered.register()
    assert KernelConfig(moe_backend="nvfp4_sm120").moe_backend == "nvfp4_sm120"


def _extend_and_restore_moe_literal():
    name = "nvfp4_sm120_moe_test"
    assert backend_names.extend_literal(backend_names.LINEAR_BACKEND, ["nvfp4_sm120_linear_test"])
    try:
        _moe_round_trip(name)
        # linear names untouched by restoring the MoE Literal
        assert KernelConfig(linear_backend="nvfp4_sm120_linear_test").linear_backend == "nvfp4_sm120_linear_test"
    finally:
        backend_names.restore(backend_names.LINEAR_BACKEND)


def _moe_round_trip(name):
    with pytest.raises(ValidationError):
        KernelConfig(moe_backend=name)
    assert backend_names.extend_literal(backend_names.MOE_BACKEND, [name])
    try:
        assert not backend_names.extend_literal(backend_names.MOE_BACKEND, [name])  # idempotent
        assert KernelConfig(moe_backend=name).moe_backend == name
        assert EngineArgs(moe_backend=name).moe_backend == name
    finally:
        backend_names.restore(backend_names.MOE_BACKEND)
    with pytest.raises(ValidationError):
        KernelConfig(moe_backend=name)
