"""The `einfold` command line: parse, ir, run, and how it reports bad input."""
import re
import subprocess
import sys

import pytest

from compiler.schedule import schedule
from compiler.check import check
from compiler.cli import main
from compiler.ir import format_program
from compiler.parse import parse
from compiler.passes import PIPELINE, run_pipeline

ATTENTION = "O[i,j] = softmax[m](Q[i,k]*K[m,k] / sqrt(len(k))) * V[m,j]"
ATTENTION_CANONICAL = "O[i, j] = sum[m](softmax[m](sum[k](Q[i, k] * K[m, k]) / sqrt(len(k))) * V[m, j])\n"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys, *argv):
    """A mistake on the command line: status 2, nothing on stdout, one line on stderr."""
    try:
        code = main(list(argv))
    except SystemExit as stop:          # argparse's own errors
        code = stop.code
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return code, err


@pytest.mark.parametrize("sms", ["0", "-3", "many"])
def test_an_sm_count_is_a_positive_integer(capsys, sms):
    code, err = usage_error(capsys, "ir", "--print-after", "specialise", "-e", ATTENTION, "--sms", sms)
    assert code == 2 and "--sms" in err


def test_specialise_needs_sizes_of_the_program(capsys):
    code, err = usage_error(capsys, "ir", "--print-after", "specialise", "-e", ATTENTION, "--size", "zz=4")
    assert code == 2 and "--size names no index of the program: zz" in err


def test_specialise_types_the_inputs_int_names(capsys):
    # ids as an int64 tensor: the scatter's fold runs over them sorted; a float tensor of ids scans
    scatter = "dE[s, d] = sum[i](where(T[i] == s, dY[i, d], 0.0))"
    sizes = ["--size", "i=64", "--size", "s=300", "--size", "d=32"]
    code, out, err = run_cli(capsys, "ir", "--print-after", "specialise", "-e", scatter, *sizes, "--int", "T")
    assert code == 0 and "[visits i sorted by T, only the positions where T[i] == s can hold]" in out, out + err
    code, out, err = run_cli(capsys, "ir", "--print-after", "specialise", "-e", scatter, *sizes)
    assert code == 0 and "sorted" not in out
    code, err = usage_error(capsys, "ir", "--print-after", "specialise", "-e", scatter, "--int", "Z")
    assert code == 2 and "--int names no tensor input of the program: Z" in err


def test_parse_expression(capsys):
    code, out, err = run_cli(capsys, "parse", "-e", ATTENTION)
    assert (code, out, err) == (0, ATTENTION_CANONICAL, "")


def test_parse_file(capsys, tmp_path):
    path = tmp_path / "layernorm.ein"
    path.write_text("# layer norm\nmu[i] = mean[k](X[i, k])\n"
                    "Y[i, k] = (X[i, k] - mu[i]) * rsqrt(mean[n]((X[i, n] - mu[i]) ** 2) + eps)\n")
    code, out, err = run_cli(capsys, "parse", str(path))
    assert code == 0 and err == ""
    assert out == ("mu[i] = mean[k](X[i, k])\n"
                   "Y[i, k] = (X[i, k] - mu[i]) * rsqrt(mean[n]((X[i, n] - mu[i]) ** 2) + eps)\n")


def test_ir_prints_the_final_ir(capsys):
    code, out, err = run_cli(capsys, "ir", "-e", ATTENTION)
    assert code == 0 and err == ""
    assert out == format_program(run_pipeline(check(parse(ATTENTION))))


def test_ir_print_after_all(capsys):
    code, out, err = run_cli(capsys, "ir", "-e", ATTENTION, "--print-after", "all")
    assert code == 0 and err == ""
    headers = re.findall(r"^# after (\S+)$", out, flags=re.M)
    assert headers == ["check"] + [name for name, _ in PIPELINE] + ["schedule"]
    sections = re.split(r"^# after \S+\n", out, flags=re.M)[1:]
    assert sections[0] == ATTENTION_CANONICAL
    program = check(parse(ATTENTION))
    for (name, pass_), text in zip(PIPELINE, sections[1:]):
        program = pass_(program)
        assert text == format_program(program), name
    assert sections[-1] == str(schedule(program, program.outputs)) + "\n"


def test_ir_print_after_schedule_shows_kernels_loops_and_bounds(capsys):
    causal = "O[i,j] = softmax[m](where(m <= i, Q[i,k] * K[m,k] * scale, -inf)) * V[m,j]"
    code, out, err = run_cli(capsys, "ir", "-e", causal, "--print-after", "schedule")
    assert code == 0 and err == "" and out.startswith("# after schedule\nschedule: 1 kernel(s), outputs O\n")
    assert "\nkernel einfold_O: grid (i, j)  # one program per (i, j) tile" in out
    # the fold is printed once and the statement reads its fields
    assert "  O[i, j] = f0.u / f0.l\n" in out
    assert "  loop m [bounds: m <= i]: fold1_r_l_u { loop k: sum }\n" in out


def test_ir_print_after_one_pass(capsys):
    code, out, err = run_cli(capsys, "ir", "-e", ATTENTION, "--print-after", "stabilise")
    assert code == 0 and err == ""
    assert out.startswith("# after stabilise\n") and out.count("# after ") == 1
    assert "- max[m](" in out                  # the exponentials are max-shifted
    code, out, err = run_cli(capsys, "ir", "-e", ATTENTION, "--print-after", "factorise")
    assert "fold1_r_l_u[m](" in out and ".u / " in out


def test_ir_unknown_pass(capsys):
    code, err = usage_error(capsys, "ir", "-e", ATTENTION, "--print-after", "nosuchpass")
    assert code == 2
    assert err.startswith("einfold ir: argument --print-after: invalid choice: 'nosuchpass' (choose from 'all', ")


def test_run(capsys):
    code, out, err = run_cli(capsys, "run", "-e", ATTENTION, "--size", "i=5", "--size", "m=7",
                             "--size", "k=3", "--size", "j=2", "--backend", "reference")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "backend reference, dtype float32"
    match = re.fullmatch(r"O: shape \(5, 2\), relative error vs float64 oracle (\S+)", lines[1])
    assert match and float(match.group(1)) < 1e-6
    assert len(lines) == 2


def test_run_bfloat16_reports_a_bfloat16_sized_error(capsys):
    code, out, _ = run_cli(capsys, "run", "-e", "C[i, j] = A[i, k] * B[k, j]", "--size", "i=3",
                           "--dtype", "bfloat16", "--backend", "reference")
    assert code == 0
    assert "backend reference, dtype bfloat16" in out
    error = float(re.search(r"C: shape \(3, 16\), relative error vs float64 oracle (\S+)", out).group(1))
    assert 0 < error < 2e-2


def test_run_several_outputs(capsys):
    code, out, _ = run_cli(capsys, "run", "-e", "S[i] = A[i] * 2; T[i] = S[i] + 1; U[i] = S[i] - 1",
                           "--size", "i=3", "--backend", "reference")
    assert code == 0
    assert re.findall(r"^(\w+): shape \(3,\)", out, flags=re.M) == ["T", "U"]


@pytest.mark.parametrize("argv, caret", [
    (["parse", "-e", "C[i] = A[i] +"], "1 | C[i] = A[i] +\n  |              ^\n"),
    (["ir", "-e", "C[i] = foo(A[i])"], "1 | C[i] = foo(A[i])\n  |        ^^^\n"),
    (["run", "-e", "C[i, j] = A[i]", "--backend", "reference"], "1 | C[i, j] = A[i]\n  |      ^\n"),
])
def test_bad_program_exits_2_with_the_caret_message(capsys, argv, caret):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.endswith(caret)
    assert "Traceback" not in err
    assert err.startswith(("einfold: syntax error: ", "einfold: error: "))


def test_bad_program_in_a_file(capsys, tmp_path):
    path = tmp_path / "bad.ein"
    path.write_text("C[i] = A[i]\nD[i] = C[i] * * 2\n")
    code, out, err = run_cli(capsys, "parse", str(path))
    assert code == 2
    assert "--> line 2, column 15" in err
    assert err.endswith("2 | D[i] = C[i] * * 2\n  |               ^\n")


def test_missing_file(capsys, tmp_path):
    code, err = usage_error(capsys, "parse", str(tmp_path / "absent.ein"))
    assert code == 2
    assert err.startswith("einfold: cannot read ") and "absent.ein" in err


def test_no_program(capsys):
    code, err = usage_error(capsys, "parse")
    assert code == 2
    assert err == "einfold: give a program with -e EXPR or a FILE\n"


def test_bad_size(capsys):
    code, err = usage_error(capsys, "run", "-e", "C[i] = A[i]", "--size", "i=x")
    assert code == 2
    assert err == "einfold: --size takes INDEX=N, got 'i=x'\n"


def test_run_fills_about_65536_points_by_default(capsys):
    # six index symbols: 6 ** 6 = 46656 points, not 16 ** 6 (minutes under the interpreter)
    four_d = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"
    code, out, _ = run_cli(capsys, "run", "-e", four_d, "--backend", "reference")
    assert code == 0 and "O: shape (6, 6, 6, 6)" in out
    # given sizes take their share: 4 * 4 leaves 4096 points to four symbols, 8 each
    code, out, _ = run_cli(capsys, "run", "-e", four_d, "--size", "b=4", "--size", "h=4", "--backend", "reference")
    assert code == 0 and "O: shape (4, 4, 8, 8)" in out
    code, out, _ = run_cli(capsys, "run", "-e", "Y[i] = sum[j](X[i,j])", "--backend", "reference")
    assert code == 0 and "Y: shape (16,)" in out       # few indices keep 16


def test_a_size_given_twice_differently(capsys):
    code, err = usage_error(capsys, "run", "-e", "C[i] = A[i]", "--size", "i=3", "--size", "i=4")
    assert code == 2
    assert err == "einfold: --size gives i twice: 3 and 4\n"


def test_cache_shows_its_folders_and_clears_the_modules(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EINFOLD_CACHE_DIR", str(tmp_path))
    run_cli(capsys, "run", "-e", "Y[i] = X[i] * 2", "--size", "i=3", "--backend", "triton")
    code, out, _ = run_cli(capsys, "cache")
    assert code == 0
    assert out.startswith(f"generated modules: {tmp_path} (1 module(s), ")
    assert "Triton's cache" in out
    code, out, _ = run_cli(capsys, "cache", "--clear")
    assert code == 0 and out == f"removed 1 generated module(s) from {tmp_path}\n"
    assert not list(tmp_path.glob("einfold_*.py"))


def test_size_of_an_unknown_index(capsys):
    code, err = usage_error(capsys, "run", "-e", "C[i] = A[i]", "--size", "q=3")
    assert code == 2
    assert err == "einfold: --size names no index of the program: q\n"


def test_python_dash_m_compiler():
    done = subprocess.run([sys.executable, "-m", "compiler", "parse", "-e", "C[i,j] = A[i,k]*B[k,j]"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stdout == "C[i, j] = sum[k](A[i, k] * B[k, j])\n"
    bad = subprocess.run([sys.executable, "-m", "compiler", "parse", "-e", "C[i] = A[i] $"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "unexpected character '$'" in bad.stderr and "Traceback" not in bad.stderr


def test_explain_prints_the_derivation(capsys):
    code, out, err = run_cli(capsys, "explain", "-e", ATTENTION)
    assert code == 0 and err == ""
    assert "dependent reductions over m: l, u use the max r" in out
    assert "h(r, r_new) = exp(r - r_new)" in out
    assert "O[i, j] = u / l" in out


def test_explain_bad_program_exits_2(capsys):
    code, out, err = run_cli(capsys, "explain", "-e", "O[i] = nope(X[i])")
    assert code == 2 and "unknown function 'nope'" in err and "^^^^" in err


def test_bench_without_a_gpu_says_so(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(capsys, "bench", "--quick")
    assert code == 2 and "needs a CUDA GPU" in err


DUMP_ATTENTION = "O[b,h,i,j] = softmax[m](Q[b,h,i,k] * K[b,h,m,k] * scale) * V[b,h,m,j]"


def test_dump_attention_is_one_kernel_carrying_the_derived_state(capsys):
    args = ["dump", "-e", DUMP_ATTENTION, "--size", "i=100", "--size", "m=300", "--size", "k=64",
            "--size", "j=64", "--dtype", "bfloat16"]
    code, first, err = run_cli(capsys, *args)
    assert code == 0 and "Traceback" not in err
    assert first.count("\ndef einfold_") == 1 and "def launch(t, n, device):" in first   # one kernel (+ helpers)
    assert "# source:\n#   " + DUMP_ATTENTION in first
    loop = first[first.index("for start_m"):first.index("tl.store")]
    for field in ("r = r_new", "l = l * ", "acc = acc * "):
        assert field in loop               # the (r, l, u) state is carried by the loop (u in tl.dot's acc)
    code, second, _ = run_cli(capsys, *args)
    assert second == first                 # deterministic


def test_dump_to_a_file(capsys, tmp_path):
    target = tmp_path / "attention_kernels.py"
    code, out, err = run_cli(capsys, "dump", "-e", DUMP_ATTENTION, "-o", str(target))
    assert code == 0 and out == "" and f"wrote {target}" in err
    compile(target.read_text(), str(target), "exec")   # the module is valid Python


# ---------------------------------------------------------------- first contact
def test_version(capsys):
    import compiler
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"einfold {compiler.__version__}\n"


def test_every_option_has_help_and_every_command_an_example():
    from compiler.cli import build_parser
    parser = build_parser()
    assert "examples:" in parser.format_help()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"parse", "ir", "run", "explain", "dump", "grad", "cache", "tune", "bench"}
    for name, sub in commands.items():
        text = sub.format_help()
        assert "examples:\n  einfold " + name in text, name
        for action in sub._actions:
            assert action.help, f"einfold {name} {action.option_strings or action.dest} has no help"
            if action.choices is not None:
                assert all(str(c) in text for c in action.choices), (name, action.dest)


def test_explain_shows_the_plan_of_the_backend_that_would_run(capsys):
    code, out, _ = run_cli(capsys, "explain", "-e", ATTENTION)
    assert code == 0
    assert "  backend triton: 1 kernel(s)\n    einfold_O: writes O  # one program per" in out
    code, out, _ = run_cli(capsys, "explain", "-e", ATTENTION, "--backend", "reference")
    assert "  backend reference: 1 kernel(s)\n    oracle_O: writes O" in out


LAYERNORM = "mu[i] = mean[j](X[i,j]); v[i] = mean[j]((X[i,j] - mu[i])**2); Y[i,j] = (X[i,j] - mu[i]) * v[i]"


@pytest.mark.parametrize("source", [ATTENTION, LAYERNORM], ids=["attention", "layernorm"])
@pytest.mark.parametrize("command", [["parse"], ["ir", "--print-after", "all"], ["explain"], ["grad"]])
def test_parse_ir_explain_and_grad_do_not_import_torch(command, source):
    # They start quickly because neither torch nor Triton's runtime is imported (torch
    # alone takes several seconds cold); the law sampler behind layernorm's derived
    # summary evaluates with numpy.
    code = ("import sys\nfrom compiler.cli import main\n"
            f"assert main({command!r} + ['-e', {source!r}]) == 0\n"
            "heavy = sorted(m for m in ('torch', 'triton') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_interpreter_warning_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "compiler", "run", "-e", "Y[i] = softmax[j](X[i,j])",
                           "--size", "i=3", "--size", "j=5", "--backend", "triton"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("einfold: warning: no CUDA tensors, so the triton backend runs")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["run", "-e", "C[i] = A[i]", "--size", "i=99999999999999999999"], "an extent is at most"),
    (["run", "-e", "C[i] = A[i]", "--seed", "99999999999999999999999"], "a seed is between 0 and"),
    (["run", "-e", "C[i] = A[i]", "--backend", "nosuch"], "invalid choice: 'nosuch'"),
    (["run", "-e", "C[i] = A[i]", "--dtype", "int8"], "invalid choice: 'int8'"),
    (["run", "-e", "C[i] = A[i,j]", "--size", "i=3000000", "--size", "j=3000000", "--backend", "reference"],
     "cannot make random inputs of these sizes"),
    (["dump", "-e", "C[i] = A[i]", "-o", "."], "cannot write .: it is a folder"),
    (["dump", "-e", "C[i] = A[i]", "-o", "no/such/folder/k.py"], "cannot write no/such/folder/k.py"),
    (["parse", "."], "cannot read .: it is a folder"),
    ([], "the following arguments are required: COMMAND"),
])
def test_command_line_mistakes_are_one_line_with_status_2(capsys, argv, message):
    code, err = usage_error(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_file_that_is_not_utf8_or_holds_nul(capsys, tmp_path):
    path = tmp_path / "bad.ein"
    path.write_bytes(b"C[i] = \xff A[i]\n")
    code, err = usage_error(capsys, "parse", str(path))
    assert code == 2 and "not UTF-8 text (byte 7)" in err
    path.write_bytes(b"C[i] = \x00 A[i]\n")
    code, out, err = run_cli(capsys, "parse", str(path))
    assert code == 2 and err.startswith("einfold: syntax error: unexpected character '\\x00'")


def test_an_empty_extent_runs(capsys):
    code, out, err = run_cli(capsys, "run", "-e", "C[i] = A[i] * 2", "--size", "i=0", "--backend", "reference")
    assert code == 0 and "C: shape (0,), relative error vs float64 oracle 0.000e+00" in out
