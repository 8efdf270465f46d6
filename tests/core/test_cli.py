"""CLI contract: bad arguments are one line with stable exit codes; fast commands import no torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forge.cli import main
from forge.testing import use_plugins


@pytest.mark.parametrize("args, message", [
    (["--tp", "0"], "--tp must be a positive integer"),
    (["--pp", "-1"], "--pp must be a positive integer"),
    (["--tp", "two"], "invalid int value"),
    (["--dtype", "float8"], "does not support --dtype float8; choose one of"),
    (["--target", "gpu"], "cannot be built for --target gpu; its targets: python, echo"),
    (["--name-prefix", "../evil"], "invalid --name-prefix"),
    (["--name-prefix", "a/b"], "invalid --name-prefix"),
    (["--max-input-len", "4096"], "--max-input-len must be smaller"),
    (["--quant", "int3"], "does not support --quant int3"),
])
def test_bad_build_arguments(toy, toy_model, tmp_path, capsys, args, message):
    """Bad inputs tried: each argument listed above."""
    out = tmp_path / "out"
    code = main(["build", "--family", "toy", "--model", str(toy_model), "--out", str(out), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("family, args, message", [
    ("minilm", ["--instances", "0"], "--instances must be at least 1, got 0"),
    ("gpt", ["--group-size", "-8"], "--group-size must be at least 1, got -8"),
    ("minilm", ["--parity-tolerance", "0"], "--parity-tolerance must be a positive number"),
    ("gpt", ["-o", "parity_tolerance=0"], "--parity-tolerance must be a positive number"),
])
def test_bad_option_flags(toy_model, tmp_path, capsys, family, args, message):
    """The flags that set a family option are checked by the family's declaration of it, before anything runs."""
    out = tmp_path / "out"
    with use_plugins(entry_points=True):
        code = main(["build", "--family", family, "--model", str(toy_model), "--out", str(out), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("case", ["missing", "empty", "out_is_file"])
def test_bad_paths(toy, toy_model, tmp_path, capsys, case):
    """Bad inputs tried: missing model dir, empty model dir, --out that is a regular file."""
    model, out = toy_model, tmp_path / "out"
    if case == "missing":
        model = tmp_path / "missing"
    elif case == "empty":
        model = tmp_path / "empty"
        model.mkdir()
    else:
        out.write_text("i am a file")
    assert main(["build", "--family", "toy", "--model", str(model), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert {"missing": "does not exist", "empty": "is empty", "out_is_file": "is a regular file"}[case] in err
    if case != "out_is_file":
        assert not out.exists()


@pytest.mark.parametrize("command", [["--help"], ["plugins"], ["validate", "."], ["build", "--help"]])
def test_fast_commands_do_not_import_torch(command, tmp_path):
    code = ("import sys\nfrom forge.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'onnxruntime') if m in sys.modules]\n"
            "assert not heavy, heavy\n" % command)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_a_command_imports_only_its_own_module(tmp_path):
    """`forge export …` builds the parser of export alone (start-up is part of every command's time);
    `forge --help` and a misspelt command still see every command."""
    code = ("import sys\nfrom forge.cli import main\ntry:\n    main(['--debug', 'export', '--help'])\nexcept SystemExit:\n"
            "    pass\nothers = sorted(m for m in sys.modules if m.startswith('forge.commands.') and m not in "
            "('forge.commands.export', 'forge.commands.build'))\nassert not others, others\n")  # export shares build's flags
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--family" in proc.stdout
    listing = subprocess.run([sys.executable, "-m", "forge", "--help"], capture_output=True, text=True).stdout
    assert all(name in listing for name in ("build", "export", "serve", "bench", "doctor"))
    typo = subprocess.run([sys.executable, "-m", "forge", "exprot"], capture_output=True, text=True)
    assert typo.returncode == 2 and "invalid choice: 'exprot'" in typo.stderr and "export" in typo.stderr


def test_openblas_threads_do_not_spin_unless_the_user_says(tmp_path):
    """numpy's OpenBLAS threads sleep at once in forge commands (they busy-waited ~0.1 s of CPU);
    a value the user set is kept."""
    code = "import os, forge.cli\nprint(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "4"
    env["OPENBLAS_THREAD_TIMEOUT"] = "20"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "20"


def test_the_console_exit_keeps_output_and_exit_handlers(tmp_path):
    """`forge` leaves without the interpreter's teardown, but only after exit handlers ran and the
    streams were flushed: piped output is complete, codes are kept, a handler's file is written."""
    marker = tmp_path / "handler-ran"
    code = ("import atexit, pathlib, sys\nfrom forge.cli import run\n"
            f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
            "sys.argv = ['forge'] + sys.argv[1:]\nrun()\n")
    done = subprocess.run([sys.executable, "-c", code, "plugins"], capture_output=True, text=True)
    assert done.returncode == 0 and "family llama" in done.stdout and done.stdout.endswith("\n")
    assert marker.read_text() == "yes"
    bad = subprocess.run([sys.executable, "-c", code, "build", "--family", "nosuch", "--model", "x", "--out", "y"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("forge: error:"), bad.stderr


def test_numpy_optional_parts_load_on_first_use_in_the_command_process(tmp_path):
    """`forge` defers numpy.random/ma/polynomial/fft/ctypeslib (~25 ms of every start): in the command's
    process they are not executed when numpy is imported, and on first use they are the real modules
    (values checked against this process's numpy)."""
    code = ("import atexit, sys\nfrom forge.cli import run\n"
            "def after():\n"
            "    import numpy\n"
            "    lazy = sorted(n for n in ('random', 'ma', 'polynomial', 'fft', 'ctypeslib')\n"
            "                  if type(sys.modules['numpy.' + n]).__name__ == '_LazyModule')\n"
            "    print(lazy, numpy.random.default_rng(7).integers(1000),\n"
            "          int(numpy.ma.masked_array([1, 2], mask=[0, 1]).sum()),\n"
            "          numpy.fft.fft([1.0, 0.0]).real.tolist(), numpy.polynomial.Polynomial([1, 2])(3),\n"
            "          numpy.ctypeslib.as_array((numpy.ctypeslib.ctypes.c_int * 2)(4, 5)).tolist())\n"
            "atexit.register(after)\n"
            "sys.argv = ['forge', 'plugins']\n"
            "run()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    import numpy

    expected = numpy.random.default_rng(7).integers(1000)
    assert done.stdout.strip().splitlines()[-1] == (f"['ctypeslib', 'fft', 'ma', 'polynomial', 'random'] {expected} 1 "
                                                    "[1.0, 1.0] 7.0 [4, 5]")


@pytest.mark.parametrize(("error", "line"), [
    (PermissionError(13, "Permission denied", "/srv/models/out"), "forge: error: /srv/models/out: Permission denied"),
    (OSError(28, "No space left on device"), "forge: error: No space left on device"),
])
def test_a_system_error_is_one_line(monkeypatch, capsys, error, line):
    """What the system refuses (a permission, a full disk) in any command is one line and exit 1, not a
    traceback; with --debug the traceback is there; a closed output pipe is left to the interpreter as before."""
    from forge.commands import plugins

    def refuse(args):
        raise error

    monkeypatch.setattr(plugins, "run", refuse)
    assert main(["plugins"]) == 1
    assert capsys.readouterr().err.strip() == line
    with pytest.raises(type(error)):
        main(["plugins", "--debug"])
    monkeypatch.setattr(plugins, "run", lambda args: (_ for _ in ()).throw(BrokenPipeError(32, "Broken pipe")))
    with pytest.raises(BrokenPipeError):
        main(["plugins"])
