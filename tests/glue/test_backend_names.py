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
    """The same machinery serves ``--moe-backend`` (for the MoE glue); undoing one extension leaves the others."""
    linear_undo = backend_names.extend_literal(backend_names.LINEAR_BACKEND, ["nvfp4_sm120_linear_test"])
    assert linear_undo is not None
    try:
        _moe_round_trip("nvfp4_sm120_moe_test")
        # linear names untouched by undoing the MoE extension
        assert KernelConfig(linear_backend="nvfp4_sm120_linear_test").linear_backend == "nvfp4_sm120_linear_test"
    finally:
        linear_undo()
    with pytest.raises(ValidationError):
        KernelConfig(linear_backend="nvfp4_sm120_linear_test")
    # the plugin's own names outlive the test's extensions
    assert KernelConfig(moe_backend="nvfp4_sm120").moe_backend == "nvfp4_sm120"
    assert KernelConfig(linear_backend="nvfp4_sm120").linear_backend == "nvfp4_sm120"


def _moe_round_trip(name):
    with pytest.raises(ValidationError):
        KernelConfig(moe_backend=name)
    undo = backend_names.extend_literal(backend_names.MOE_BACKEND, [name])
    assert undo is not None
    try:
        assert backend_names.extend_literal(backend_names.MOE_BACKEND, [name]) is None  # idempotent
        assert KernelConfig(moe_backend=name).moe_backend == name
        assert EngineArgs(moe_backend=name).moe_backend == name  # EngineArgs loads vLLM's general plugins
    finally:
        undo()
    with pytest.raises(ValidationError):
        KernelConfig(moe_backend=name)


def test_registration_inside_another_extension(registered, monkeypatch):
    """vLLM may run the plugin's registration at any time (``EngineArgs`` loads the general plugins): undoing an
    extension made before it must not take the plugin's names away, nor leave them behind after unregister."""
    import vllm.plugins

    registered.unregister()
    try:
        undo = backend_names.extend_literal(backend_names.MOE_BACKEND, ["nvfp4_sm120_moe_test"])
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        EngineArgs(moe_backend="nvfp4_sm120_moe_test")  # registers the plugin
        assert registered.is_registered()
        undo()
        assert KernelConfig(moe_backend="nvfp4_sm120").moe_backend == "nvfp4_sm120"
        with pytest.raises(ValidationError):
            KernelConfig(moe_backend="nvfp4_sm120_moe_test")
        registered.unregister()
        with pytest.raises(ValidationError):
            KernelConfig(moe_backend="nvfp4_sm120")
    finally:
        registered.register()
    assert registered.is_registered()


@pytest.mark.parametrize("name", BACKEND_NAMES[:1])
def test_speculative_config_accepts_moe_name(registered, name):
    from vllm.config.speculative import SpeculativeConfig

    from vllm_nvfp4_sm120.vllm.moe import BACKEND_NAMES as MOE_NAMES

    for moe_name in MOE_NAMES:
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
                                   prompt_lookup_min=1, moe_backend=moe_name)
        assert config.moe_backend == moe_name
    with pytest.raises(ValidationError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, moe_backend=UNKNOWN[0])
