"""Measured configs (dispatch/configs.py): the schema, where files are read from and in which order, every way a
file can be unusable (one warning, the built-in row), and the hooks in the linear and MoE selectors."""

import copy
import json
import tomllib
import warnings
from pathlib import Path

import pytest

from vllm_nvfp4_sm120.dispatch import configs
from vllm_nvfp4_sm120.dispatch.configs import MeasuredConfigWarning
from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.dispatch.linear import LinearPlan, select_linear, table_linear
from vllm_nvfp4_sm120.dispatch.moe import Impl, MoeKernel, select_moe_plan, table_moe_plan, tier_plan

DEVICE = "NVIDIA Test GPU"  # not a real GPU: no shipped file can match it
H200 = Capability(90, 132, DEVICE)
RTX = Capability(120, 170, DEVICE)
N, K = 10240, 5120
MMA8W8 = {"block_m": 16, "block_t": 8, "num_warps": 8}
GEMM_MID = {"block_m": 64, "block_n": 64, "block_k": 128, "group_m": 8, "num_warps": 4, "num_stages": 3,
            "swap_ab": False}
MOE = dict(top_k=8, global_experts=128, hidden=2048, intermediate=768)


def doc(family="linear_w4a16", buckets=None, cc=90, **top):
    """A valid config document (the built-in table would not pick these rows on its own)."""
    if buckets is None:
        buckets = {f"N={N},K={K}": [
            {"min_t": 2, "max_t": 8, "kernel": "gluon_gemv_mma", "tile": dict(MMA8W8), "us": {"x": 1.0}, "why": "w"},
            {"min_t": 160, "max_t": 200, "kernel": "w4a16_gemm", "tile": dict(GEMM_MID)},
        ]}
    return {"schema_version": 1, "package_version": "0.1.0", "device_name": configs.device_key(DEVICE),
            "family": family, "cc": cc, "sm_count": 132, "measured": {"date": "2026-12-01"}, "buckets": buckets, **top}


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """``(user, shipped)`` empty folders, the user one in $VLLM_NVFP4_SM120_CONFIG_DIR; caches cleared around."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(configs.ENV_CONFIG_DIR, str(user))
    monkeypatch.setattr(configs, "SHIPPED_DIR", shipped)
    configs.clear_cache()
    yield user, shipped
    configs.clear_cache()


def write(folder: Path, data, family="linear_w4a16", device=DEVICE) -> Path:
    path = folder / configs.config_file_name(device, family)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    configs.clear_cache()
    return path


def mma8w8_plan():
    return LinearPlan("gluon_gemv_mma", tuple(sorted(MMA8W8.items())))


# ---- names and schema ------------------------------------------------------------------------------------------

def test_file_names_follow_vllm():
    assert configs.config_file_name("NVIDIA H200", "linear_w4a16") == "device_name=NVIDIA_H200,family=linear_w4a16.json"
    assert configs.device_key("NVIDIA GeForce RTX 5090") == "NVIDIA_GeForce_RTX_5090"
    assert configs.device_key("A/B (x)") == "A_B__x_"


def test_a_valid_file_loads(folders):
    cf = configs.load_file(write(folders[0], doc()))
    assert cf.error is None and cf.cc == 90 and cf.arch == "sm90" and list(cf.buckets) == [(N, K)]
    rows = cf.buckets[(N, K)]
    assert [(r.min_t, r.max_t) for r in rows] == [(2, 8), (160, 200)]
    assert rows[0].us == {"x": 1.0} and rows[0].why == "w" and rows[0].t_range() == "T 2-8"


def test_every_listed_tile_is_accepted_on_its_architecture(folders):
    for cc in (120, 90):
        arch = Capability(cc).family
        for kernel in configs.route_kernels("w4a16"):
            for tile in configs.linear_tiles(arch, kernel):
                limit = configs.kernel_max_t(kernel)
                row = {"min_t": 1, "max_t": limit or 64, "kernel": kernel, "tile": tile}
                cf = configs.load_file(write(folders[0], doc(buckets={f"N={N},K={K}": [row]}, cc=cc)))
                assert cf.error is None, (cc, kernel, tile, cf.error)


# ---- the hooks ---------------------------------------------------------------------------------------------------

def test_a_measured_row_replaces_the_table_where_it_covers(folders):
    write(folders[0], doc())
    assert table_linear(H200, "w4a16", 4, N, K).kwargs["num_warps"] == 4  # the table's own tile differs
    for t in (2, 4, 8):
        assert select_linear(H200, "w4a16", t, N, K) == mma8w8_plan()
    plan = select_linear(H200, "w4a16", 170, N, K)
    assert plan == LinearPlan("w4a16_gemm", tuple(sorted(GEMM_MID.items())))
    # Not covered: other T, other shapes, other routes, a GPU without a name, another device name.
    unnamed, other = Capability(90, 132), Capability(90, 132, "NVIDIA Other")
    for t, n, k, route, cap in [(1, N, K, "w4a16", H200), (9, N, K, "w4a16", H200), (201, N, K, "w4a16", H200),
                                (4, N, 8192, "w4a16", H200), (4, N, K, "triton", H200), (4, N, K, "w4a16", unnamed),
                                (4, N, K, "w4a16", other)]:
        assert select_linear(cap, route, t, n, k) == table_linear(cap, route, t, n, k), (t, n, k, route, cap)


def test_derived_parameters_are_added_per_call(folders):
    gemv = {"block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 4}
    write(folders[0], doc(buckets={f"N={N},K={K}": [{"min_t": 1, "max_t": 16, "kernel": "w4a16_gemv", "tile": gemv},
                                                    {"min_t": 17, "max_t": None, "kernel": "w4a16_dequant_mm",
                                                     "tile": {}}]}))
    from vllm_nvfp4_sm120.dispatch.linear import dequant_mm_chunk_n, gemv_split_k

    for t in (1, 16):
        assert select_linear(H200, "w4a16", t, N, K).kwargs == dict(gemv, split_k=gemv_split_k(N, K, 64, 256, 132, t))
    for t in (17, 100_000):
        assert select_linear(H200, "w4a16", t, N, K).kwargs == {"chunk_n": dequant_mm_chunk_n(t, N, K, 132)}


def test_a_gluon_row_yields_to_the_switch(folders, monkeypatch):
    write(folders[0], doc())
    monkeypatch.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
    assert select_linear(H200, "w4a16", 4, N, K) == table_linear(H200, "w4a16", 4, N, K)
    assert select_linear(H200, "w4a16", 4, N, K).kernel == "w4a16_gemv"


def moe_doc(w4a4=True, rows=None):
    rows = rows if rows is not None else [
        {"min_t": 1, "max_t": 100, "kernel": "w4a4", "impl": "triton", "block_m": 32},
        {"min_t": 2000, "max_t": None, "kernel": "w4a16", "impl": "gluon", "block_m": 64}]
    return doc(family=configs.moe_family(w4a4), cc=120, buckets={configs.moe_bucket(128, 8, 2048, 768): rows})


def test_the_moe_selector_reads_measured_tiers(folders):
    write(folders[0], moe_doc(), family="moe_w4a4")
    plan = select_moe_plan(RTX, num_tokens=16, w4a4=True, **MOE)
    assert plan == tier_plan(RTX, MoeKernel.W4A4, 32, hidden=2048, intermediate=768)
    assert plan != table_moe_plan(RTX, num_tokens=16, w4a4=True, **MOE)
    big = select_moe_plan(RTX, num_tokens=4096, w4a4=True, **MOE)
    assert (big.kernel, big.impl, big.block_m) == ("w4a16", "gluon", 64)
    for t, w4a4, shape in [(500, True, MOE), (16, False, MOE), (16, True, dict(MOE, intermediate=1536))]:
        assert select_moe_plan(RTX, num_tokens=t, w4a4=w4a4, **shape) == table_moe_plan(RTX, num_tokens=t,
                                                                                         w4a4=w4a4, **shape)


# ---- precedence ----------------------------------------------------------------------------------------------------

def test_user_folder_over_shipped_over_table(folders):
    user, shipped = folders
    other = dict(GEMM_MID, block_m=128, block_n=128, num_warps=8)  # the sm_120 / sm_90 128 x 128 tile
    write(shipped, doc(buckets={f"N={N},K={K}": [{"min_t": 100, "max_t": 300, "kernel": "w4a16_gemm",
                                                  "tile": other}]}))
    shipped_plan = LinearPlan("w4a16_gemm", tuple(sorted(other.items())))
    assert select_linear(H200, "w4a16", 170, N, K) == shipped_plan
    write(user, doc())
    assert select_linear(H200, "w4a16", 170, N, K).kwargs == GEMM_MID  # user row wins where both cover T
    assert select_linear(H200, "w4a16", 250, N, K) == shipped_plan  # the shipped row serves what the user's leaves
    assert select_linear(H200, "w4a16", 301, N, K) == table_linear(H200, "w4a16", 301, N, K)


def test_without_the_variable_only_shipped_files_count(folders, monkeypatch):
    user, shipped = folders
    write(user, doc())
    monkeypatch.delenv(configs.ENV_CONFIG_DIR)
    configs.clear_cache()
    assert [source for source, _ in configs.config_dirs()] == ["shipped"]
    assert select_linear(H200, "w4a16", 4, N, K) == table_linear(H200, "w4a16", 4, N, K)


# ---- unusable files: one warning, the built-in row ----------------------------------------------------------------

def _mutate(path, value):
    """A copy of ``doc()`` with ``path`` (keys / indices) set to ``value`` (``...``: deleted)."""
    d = copy.deepcopy(doc())
    *head, last = path
    node = d
    for key in head:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return d


ROW0 = ("buckets", f"N={N},K={K}", 0)
BROKEN = {
    "bad JSON": ("{not json", "malformed JSON"),
    "not an object": ("[1, 2]", "expected a JSON object"),
    "unknown top key": (_mutate(("extra",), 1), "unknown key(s) ['extra']"),
    "unknown row key": (_mutate((*ROW0, "block"), 3), "unknown key(s) ['block']"),
    "other schema": (_mutate(("schema_version",), 2), "schema_version 2"),
    "device mismatch": (_mutate(("device_name",), "NVIDIA_H100"), "differs from the file name"),
    "kernel removed": (_mutate((*ROW0, "kernel"), "gluon_gemv_wgmma"), "kernel 'gluon_gemv_wgmma' does not exist"),
    "kernel not of the route": (_mutate((*ROW0, "kernel"), "w4a4_triton"), "cannot serve route w4a16"),
    "tile not listed": (_mutate((*ROW0, "tile"), dict(MMA8W8, num_warps=2)), "is not one of gluon_gemv_mma's tiles"),
    "tile key missing": (_mutate((*ROW0, "tile", "num_warps"), ...), "is not one of gluon_gemv_mma's tiles"),
    "derived param in tile": (_mutate((*ROW0, "tile"), dict(MMA8W8, split_k=2)), "is not one of"),
    "decode row too long": (_mutate((*ROW0, "max_t"), 64), "serves T <= 32, the row reaches 64"),
    "open decode row": (_mutate((*ROW0, "max_t"), None), "serves T <= 32, the row reaches any T"),
    "min_t zero": (_mutate((*ROW0, "min_t"), 0), "min_t is 0"),
    "max_t below min_t": (_mutate((*ROW0, "max_t"), 1), "max_t is 1"),
    "overlap": (_mutate(("buckets", f"N={N},K={K}", 1, "min_t"), 5), "overlap or are out of order"),
    "bad bucket": (_mutate(("buckets",), {"10240x5120": []}), "bucket '10240x5120' is not N=<int>,K=<int>"),
    "K not NVFP4": (_mutate(("buckets",), {"N=16,K=40": [{"min_t": 1, "max_t": 1, "kernel": "w4a16_dequant_mm",
                                                         "tile": {}}]}), "not an NVFP4 shape"),
    "empty bucket": (_mutate(("buckets",), {f"N={N},K={K}": []}), "non-empty list"),
    "no buckets": (_mutate(("buckets",), ...), "buckets is missing"),
    "bad timings": (_mutate((*ROW0, "us"), {"x": "fast"}), "us is not an object"),
    "bad cc": (_mutate(("cc",), 75), "cc 75"),
    "route not on arch": (dict(doc(family="linear_cublas"), family="linear_cublas"), "route cublas has no kernels"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_unusable_file_warns_once_and_the_table_serves(folders, case):
    data, reason = BROKEN[case]
    family = "linear_cublas" if case == "route not on arch" else "linear_w4a16"
    path = write(folders[0], data, family=family)
    route = family.removeprefix("linear_")
    with pytest.warns(MeasuredConfigWarning) as record:
        if route == "cublas":
            plan = configs.measured_linear_plan(H200, route, 4, N, K)
            assert plan is None
        else:
            assert select_linear(H200, route, 4, N, K) == table_linear(H200, route, 4, N, K)
    assert len(record) == 1
    message = str(record[0].message)
    assert str(path) in message and reason in message and "built-in table serves" in message, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second lookup reads nothing again and warns no more
        assert configs.measured_linear_plan(H200, route, 4, N, K) is None


def test_a_file_of_another_architecture_is_not_used(folders):
    write(folders[0], doc(cc=120))
    with pytest.warns(MeasuredConfigWarning, match="measured on sm120 .*this GPU is sm90"):
        assert select_linear(H200, "w4a16", 4, N, K) == table_linear(H200, "w4a16", 4, N, K)


def test_a_broken_user_file_leaves_the_shipped_one_in_use(folders):
    user, shipped = folders
    write(shipped, doc())
    write(user, "{")
    with pytest.warns(MeasuredConfigWarning, match="malformed JSON"):
        assert select_linear(H200, "w4a16", 4, N, K) == mma8w8_plan()


@pytest.mark.parametrize("rows,reason", [
    ([{"min_t": 1, "max_t": 8, "kernel": "w4a4", "impl": "triton", "block_m": 16}], "is not a tier this layer"),
    ([{"min_t": 1, "max_t": 8, "kernel": "w4a16", "impl": "gluon", "block_m": 16}], "is not a tier this layer"),
    ([{"min_t": 1, "max_t": 8, "kernel": "w4a16", "impl": "triton", "block_m": 48}], "is not a tier this layer"),
    ([{"min_t": 1, "max_t": 8, "kernel": "w8a8", "impl": "triton", "block_m": 16}], "does not exist"),
    ([{"min_t": 1, "max_t": 8, "kernel": "w4a16", "impl": "cutlass", "block_m": 16}], "does not exist"),
    ([{"min_t": 1, "max_t": 8, "kernel": "w4a16", "impl": "triton", "block_m": 16, "tile": {}}], "unknown key"),
])
def test_unusable_moe_rows(folders, rows, reason):
    write(folders[0], moe_doc(w4a4=False, rows=rows), family="moe_w4a16")  # a W4A16 layer cannot run W4A4
    with pytest.warns(MeasuredConfigWarning, match=reason):
        plan = select_moe_plan(RTX, num_tokens=4, w4a4=False, **MOE)
    assert plan == table_moe_plan(RTX, num_tokens=4, w4a4=False, **MOE)


def test_moe_choices_follow_the_tier_tables():
    choices = configs.moe_choices(RTX, w4a4=True)
    assert {"kernel": "w4a4", "impl": "gluon", "block_m": 128} in choices
    assert {"kernel": "w4a16", "impl": "gluon", "block_m": 16} not in choices  # Gluon has BLOCK_M 64 / 128 only
    assert all(c["kernel"] == "w4a16" for c in configs.moe_choices(RTX, w4a4=False))
    assert all(c["impl"] == "triton" for c in configs.moe_choices(Capability(80), w4a4=True))
    for c in choices:
        assert tier_plan(RTX, MoeKernel(c["kernel"]), c["block_m"], hidden=2048, intermediate=768,
                         impl=Impl(c["impl"])) is not None


# ---- shipped files and packaging ----------------------------------------------------------------------------------

SHIPPED = sorted(configs.SHIPPED_DIR.glob("device_name=*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_file_is_usable(path):
    cf = configs.load_file(path)
    assert cf.error is None, cf.error
    assert cf.package_version and cf.buckets


def test_shipped_configs_are_package_data():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "configs/*.json" in pyproject["tool"]["setuptools"]["package-data"]["vllm_nvfp4_sm120"]
    assert configs.SHIPPED_DIR == Path(configs.__file__).resolve().parents[1] / "configs"
    assert configs.SHIPPED_DIR.is_dir()


SHIPPED_FILES = sorted(configs.SHIPPED_DIR.glob("device_name=*.json"))


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=[p.name for p in SHIPPED_FILES])
def test_shipped_file_validates_and_drives_the_dispatch(path, monkeypatch):
    """Every shipped file loads without a warning, and at each T it has a row for the linear selector returns that
    row's plan (the measured winner), for the device it names."""
    monkeypatch.delenv(configs.ENV_CONFIG_DIR, raising=False)
    configs.clear_cache()
    cf = configs.load_file(path, "shipped")
    assert cf.error is None, cf.error
    data = json.loads(path.read_text())
    if not cf.family.startswith("linear_"):
        pytest.skip("MoE files are checked through their rows by the loader only")
    cap = Capability(data["cc"], data["sm_count"], data["measured"]["device"])
    route = cf.family.removeprefix("linear_")
    checked = 0
    for bucket, rows in data["buckets"].items():
        n, k = (int(part.split("=")[1]) for part in bucket.split(","))
        for row in rows:
            for t in {row["min_t"], row["max_t"]}:
                plan = select_linear(cap, route, t, n, k)
                assert plan.kernel == row["kernel"], (bucket, t, plan)
                assert {key: v for key, v in plan.params if key not in configs.DERIVED_PARAMS} == row["tile"], (
                    bucket, t, plan)
                checked += 1
    assert checked
    configs.clear_cache()
