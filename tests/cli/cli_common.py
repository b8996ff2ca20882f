"""What the CLI tests share (import as ``from cli_common import ...``)."""

from vllm_nvfp4_sm120 import cli


def run_cli(capsys, *argv):
    """``(exit code, stdout, stderr)`` of ``vllm-nvfp4-sm120 ARGV`` run in-process."""
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def problem_lines(out: str) -> list[str]:
    """The PROBLEM lines of an ``inspect`` text report, without the prefix."""
    return [line.strip().removeprefix("PROBLEM: ") for line in out.splitlines() if line.strip().startswith("PROBLEM:")]


def one_line_error(code: int, out: str, err: str) -> str:
    """Assert a one-line ``error: ...`` on stderr with exit code 2 and no traceback; return the line."""
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    return lines[0]


def edit_json(path, edit) -> None:
    """Rewrite a JSON file of a written checkpoint with ``edit(data)`` (which changes ``data`` in place)."""
    import json

    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
