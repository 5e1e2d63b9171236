"""Each command of pretrain reads its arguments before torch loads (pretrain/train_args.py,
pretrain/evaluation/generate_args.py and evaluate_args.py, pretrain/hf/export_args.py): --help and
a usage error answer at once (in one line for the commands that read a checkpoint), whether run as
`python -m` or as the installed console command (pyproject.toml's [project.scripts] name the same
main)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from support.processes import ROOT, launcher_env

COMMANDS = {  # python -m module: the module that reads its arguments, and the arguments it requires
    "pretrain": ("pretrain.train_args", []),
    "pretrain.generate": ("pretrain.evaluation.generate_args", ["--checkpoint", "ckpt", "--prompt", "x"]),
    "pretrain.evaluate": ("pretrain.evaluation.evaluate_args", ["--checkpoint", "ckpt", "--data", "x.jsonl"]),
    "pretrain.export": ("pretrain.hf.export_args", ["--checkpoint", "ckpt"]),
}


def imported_modules(stderr: str) -> set[str]:
    """The modules `python -X importtime` says the process imported."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", *argv], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", COMMANDS)
def test_help_answers_without_importing_torch(module):
    result = run("-m", module, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout and f"python -m {module}" in result.stdout
    imported = imported_modules(result.stderr)
    assert COMMANDS[module][0] in imported and "torch" not in imported  # the first: the check sees the imports


@pytest.mark.parametrize("module", COMMANDS)
def test_a_usage_error_exits_2_naming_the_option_without_importing_torch(module):
    result = run("-m", module, *COMMANDS[module][1], "--no-such-option")
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: unrecognized arguments: --no-such-option" in said[-1]
    assert "Traceback" not in result.stderr and "torch" not in imported_modules(result.stderr)


@pytest.mark.parametrize("module", [m for m in COMMANDS if m != "pretrain"])
def test_missing_required_arguments_are_named_in_one_line_before_torch_loads(module):
    result = run("-m", module)
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    required = ", ".join(COMMANDS[module][1][0::2])  # the options, without their values
    assert said == [f"{module.split('.')[-1]}: error: the following arguments are required: {required} (see --help)"]
    assert result.returncode == 2 and "torch" not in imported_modules(result.stderr)


def test_the_installed_commands_run_the_same_mains_that_read_their_arguments_first():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for module in ("generate", "evaluate", "export"):
        assert scripts[f"pretrain-{module}"] == f"pretrain.{module}:main"
    code = (
        "import sys; sys.argv = ['pretrain-export', '--help']\n"
        "from pretrain.export import main\n"
        "try:\n    main()\nexcept SystemExit as done:\n    print('exit', done.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120
    )
    assert result.stdout.startswith("usage: pretrain-export") and result.stdout.rstrip().endswith("exit 0 False"), result


@pytest.mark.parametrize("module", [m for m in COMMANDS if m != "pretrain"])
def test_a_main_called_with_arguments_runs_the_command_on_those_not_the_command_line(module, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    argv = [a if a != "ckpt" else str(missing) for a in COMMANDS[module][1]]
    code = f"import sys\nfrom {module} import main\nsys.exit(main({argv!r}))\n"
    result = subprocess.run(
        [sys.executable, "-c", code, "--ignored"], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and f"--checkpoint {missing}: no such directory" in result.stderr, result.stderr
