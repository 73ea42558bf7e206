"""Bad input: one clear line on stderr, exit code 2, nothing started."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(60)


def _hostfile(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


CASES = {
    "unknown option": (lambda t, s: ["--bogus", "--", s], "unrecognized arguments: --bogus"),
    "-n 0": (lambda t, s: ["-n", "0", "--", s], "argument -n/-np/--np: must be at least 1, got 0"),
    "-n not a number": (lambda t, s: ["-n", "four", "--", s], "'four' is not a whole number"),
    "missing script": (lambda t, s: ["-n", "2"], "missing script"),
    "missing script after --": (lambda t, s: ["-n", "2", "--"], "missing script"),
    "malformed -x": (lambda t, s: ["-x", "NOEQUALS", "--", s], "'NOEQUALS' is not NAME=VALUE"),
    "bad -x name": (lambda t, s: ["-x", "1A=2", "--", s], "'1A' in '1A=2' is not a valid variable name"),
    "duplicate hostfile names": (
        lambda t, s: ["--hostfile", _hostfile(t, "nodeA\n# c\n\nnodeB slots=2\nnodeA\n"), "--", s],
        "host 'nodeA' is listed twice (first on line 1)"),
    "unreadable hostfile": (lambda t, s: ["--hostfile", str(t / "nope"), "--", s],
                            "cannot read hostfile"),
    "hostfile is a directory": (lambda t, s: ["--hostfile", str(t), "--", s], "cannot read hostfile"),
    "empty hostfile": (lambda t, s: ["--hostfile", _hostfile(t, "# nothing\n\n"), "--", s],
                       "lists no hosts"),
    "bad slots": (lambda t, s: ["--hostfile", _hostfile(t, "a slots=0\n"), "--", s],
                  "slots='0' must be a positive integer"),
    "too many ranks for the hosts": (
        lambda t, s: ["--hostfile", _hostfile(t, "localhost slots=2\n"), "-n", "3", "--", s],
        "-n 3 asks for more ranks than the hosts offer"),
    "script not found": (lambda t, s: ["-n", "2", "--", str(t / "missing.py")], "not found"),
    "script is a directory": (lambda t, s: ["-n", "2", "--", str(t)], "is a directory; give the Python file"),
    # a wrong size made the ranks wait for peers that never came (1800 s, then a host error)
    "-x TNT_SIZE": (lambda t, s: ["-n", "2", "-x", "TNT_SIZE=5", "--", s],
                    "-x TNT_SIZE=...: tnt run sets TNT_SIZE itself (the number of ranks: -n)"),
    "-x TNT_RENDEZVOUS_KEY": (lambda t, s: ["-x", "TNT_RENDEZVOUS_KEY=k", "--", s],
                              "tnt run sets TNT_RENDEZVOUS_KEY itself"),
    "far more ranks than CPUs": (lambda t, s: ["-n", "100000", "--", s],
                                 "100000 ranks on this machine, which has "),
    "unknown backend": (lambda t, s: ["--backend", "no-such-backend", "--", s],
                        "unknown backend 'no-such-backend'; installed:"),
    # the name in other case: it suggested `pip install tnt-comm-Local?`
    "backend name in other case": (lambda t, s: ["--backend", "Local", "--", s],
                                   "unknown backend 'Local'; did you mean local? installed: "),
    "backend that cannot serve the job": (lambda t, s: ["-n", "2", "--backend", "local", "--", s],
                                          "backend 'local' cannot run a job of 2 rank(s)"),
    "unknown launcher": (lambda t, s: ["--launcher", "pbs", "--", s], "invalid choice: 'pbs'"),
    "bad log level": (lambda t, s: ["--log-level", "loud", "--", s], "'loud' is not one of DEBUG"),
    "negative fusion threshold": (lambda t, s: ["--fusion-threshold", "-1", "--", s],
                                  "must be a finite number >= 0"),
    "zero timeout": (lambda t, s: ["--timeout", "0", "--", s], "must be greater than 0"),
    "--force without --cleanup": (lambda t, s: ["--force", "--", s], "--force only goes with --cleanup"),
    "script before --": (lambda t, s: [s, "--", "x"], "before '--'"),
    "local launcher with a remote host": (
        lambda t, s: ["--launcher", "local", "--hostfile", _hostfile(t, "not-here.invalid\n"), "--", s],
        "is not this machine"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line_and_exit_2(run_tnt, h, tmp_path, case):
    make_args, expected = CASES[case]
    marker = h.rank_script("marker.py")
    res = run_tnt(*make_args(tmp_path, marker))
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("tnt run: error: "), lines[0]
    assert expected in lines[0]
    assert res.stdout == ""
    assert not list(tmp_path.glob("ran.*"))


def test_tarantella_reports_under_its_own_name(run_tnt):
    res = run_tnt("-n", "0", "--", "x.py", program="tarantella", subcommand=())
    assert res.returncode == 2
    assert res.stderr.startswith("tarantella: error: argument -n/-np/--np: must be at least 1")


@pytest.mark.parametrize("args, expected", [
    ((), "usage: tnt COMMAND"),
    (("frobnicate",), "tnt: error: unknown command 'frobnicate'"),
])
def test_tnt_without_a_valid_command(run_tnt, args, expected):
    res = run_tnt(*args, subcommand=())
    assert res.returncode == 2
    assert expected in res.stderr


def test_tnt_backends_lists_installed_backends(run_tnt):
    res = run_tnt(subcommand=("backends",))
    assert res.returncode == 0, res.stderr
    names = [line.split()[0] for line in res.stdout.splitlines()]
    assert {"local", "store"} <= set(names)


def test_tnt_settings_lists_every_declared_setting(run_tnt):
    from tnt_core import installed_settings

    installed = installed_settings()
    res = run_tnt(subcommand=("settings",))
    assert res.returncode == 0, res.stderr
    listed = re.findall(r"^  (TNT_\w+)$", res.stdout, re.MULTILINE)
    assert listed == [n for n, v in installed.variables.items() if v.group != "internal"]
    assert "      default: 1800; allowed: a number > 0.0; tnt run --timeout\n" in res.stdout
    for group in installed.plugin_groups:
        assert f" -- {group.prefix}* of {installed.owner(group.name)}\n" in res.stdout
    bad = run_tnt("nope", subcommand=("settings",))
    assert bad.returncode == 2 and bad.stderr.startswith(
        "tnt settings: error: no setting group 'nope'; groups: launcher, settings, plugins, "
        "internal"), bad.stderr


def test_tnt_run_help_points_to_the_settings_and_names_the_plugins_prefixes(run_tnt):
    from tnt_core import installed_settings

    res = run_tnt("--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "'tnt settings' lists each with its default and allowed values" in text
    for group in installed_settings().plugin_groups:
        assert f"{group.name}: {group.prefix}*" in text


def test_many_more_ranks_than_cpus_is_a_warning(run_tnt, h, tmp_path):
    import os

    cpus = len(os.sched_getaffinity(0))
    few = run_tnt("-n", str(4 * cpus), "--dry-run", "--", h.rank_script("marker.py"))
    assert few.returncode == 0 and "warning" not in few.stderr, few.stderr
    many = 4 * cpus + 1
    res = run_tnt("-n", str(many), "--dry-run", "--", h.rank_script("marker.py"))
    assert res.returncode == 0, res.stderr
    assert (f"tnt run: warning: {many} ranks on this machine's {cpus} CPU(s): oversubscribed"
            in res.stderr), res.stderr


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("TNT_STALL_WARN_S", "abc", "TNT_STALL_WARN_S='abc' is not a number"),
    ("TNT_OVERLAP", "maybe", "TNT_OVERLAP='maybe' is not a boolean"),
])
def test_a_bad_exported_setting_fails_in_the_launcher(run_tnt, h, tmp_path, name, value, expected):
    """Settings the ranks read (not only tnt run's own) are checked before a rank starts:
    before, the ranks failed after loading their framework, with a traceback each."""
    res = run_tnt("-n", "2", "--", h.rank_script("marker.py"), env={name: value})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tnt run: error: {expected}"), res.stderr
    assert lines[0].endswith("(exported in the shell that runs tnt run)")
    assert not list(tmp_path.glob("ran.*"))
