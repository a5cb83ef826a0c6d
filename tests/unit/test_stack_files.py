"""Every stack file gets a clear answer fast: one class of hostile or broken file per test.

The answer is exit 0, or exit 2 with one line `geotrain: error: <file>: <key path>: <what,
the value, the fix>` of at most LINE_LIMIT characters. The worst cases run as real
processes under a memory cap and a kill timer (LIMIT_S), and report their peak memory.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from geotrain.cli import cli
from infra.model import yaml_safe
from training.errors import MAX_ERROR_CHARS

REPO = Path(__file__).resolve().parents[2]
LOCAL = (REPO / "stacks" / "Pulumi.local.yaml").read_text()
PREFIX = "geotrain: error: "
LINE_LIMIT = len(PREFIX) + MAX_ERROR_CHARS
LIMIT_S = 5.0
"""The promise: an answer within 5 s. A process still running then is killed (test fails)."""
MEMORY_CAP = 1 << 30
"""Address-space cap for the child, so a regression fails fast instead of eating the host."""
PEAK_RSS_MB = 200
"""A bounded answer: interpreter, pydantic and a 1 MiB file fit well under this."""


@dataclass
class Answer:
    code: int
    line: str
    """stderr, which must be one line for exit 2."""
    peak_rss_mb: float = 0.0


def one_line(code: int, stderr: str, stdout: str) -> Answer:
    """Check the contract (exit 0, or exit 2 with one short line) and return the answer."""
    assert "Traceback" not in stderr + stdout
    assert code in (0, 2), (code, stderr[-2000:])
    if code == 2:
        lines = stderr.splitlines()
        assert len(lines) == 1, stderr[:2000]
        assert lines[0].startswith(PREFIX) and len(lines[0]) <= LINE_LIMIT, lines[0]
    return Answer(code, stderr.strip())


def validate(path: Path | str) -> Answer:
    """`geotrain validate --stack path` in-process."""
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return one_line(r.exit_code, r.stderr, r.stdout)


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


PEAK_PROBE = """
import atexit, runpy, sys
out = sys.argv[1]
def peak():
    with open("/proc/self/status") as s, open(out, "w") as o:
        o.write(next(x for x in s if x.startswith("VmHWM:")).split()[1])
atexit.register(peak)
sys.argv = ["geotrain", *sys.argv[2:]]
runpy.run_module("geotrain", run_name="__main__", alter_sys=True)
"""
"""`python -m geotrain ARGS` that writes its own peak RSS (KiB, VmHWM) to argv[1] at exit."""


def validate_process(path: Path, tmp_path: Path) -> Answer:
    """`python -m geotrain validate --stack path` as a real process, killed after LIMIT_S;
    its peak RSS is its own VmHWM, written as it exits. (wait4's ru_maxrss would not do: the
    kernel carries the forked copy of this test process, torch and all, across exec.)"""
    out, err, peak = tmp_path / "stdout", tmp_path / "stderr", tmp_path / "peak_kib"
    with out.open("wb") as o, err.open("wb") as e:
        p = subprocess.Popen(
            [sys.executable, "-c", PEAK_PROBE, str(peak), "validate", "--stack", str(path)],
            stdout=o,
            stderr=e,
            cwd=REPO,
            preexec_fn=_cap_memory,
        )
        killer = threading.Timer(LIMIT_S, p.kill)
        killer.start()
        try:
            _, status, _ = os.wait4(p.pid, 0)
        finally:
            killer.cancel()
    p.returncode = code = os.waitstatus_to_exitcode(status)
    assert code != -9, f"no answer within {LIMIT_S} s"
    answer = one_line(code, err.read_text(errors="replace"), out.read_text(errors="replace"))
    answer.peak_rss_mb = int(peak.read_text()) / 1024
    assert answer.peak_rss_mb < PEAK_RSS_MB, answer
    return answer


def write(tmp_path: Path, text: str | bytes, name: str = "Pulumi.bad.yaml") -> Path:
    f = tmp_path / name
    if isinstance(text, bytes):
        f.write_bytes(text)
    else:
        f.write_text(text, encoding="utf-8")
    return f


def alias_bomb(levels: int) -> str:
    """The local stack plus "billion laughs": each level lists the one below 9 times, so
    the last expands to 9**levels strings."""
    lines = [
        LOCAL.rstrip("\n"),
        "  x:",
        "    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]",
    ]
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    lines.append(f"  geotrain:policy: {{allowed_regions: *a{levels - 1}}}")
    return "\n".join(lines) + "\n"


# -- YAML aliases ---------------------------------------------------------------------------


def test_alias_bomb_is_rejected_in_under_5_s_with_one_line(tmp_path: Path) -> None:
    a = validate_process(write(tmp_path, alias_bomb(12)), tmp_path)  # 9**12 = 2.8e11 strings
    assert a.code == 2
    assert "x.a1[0]: line" in a.line and "YAML alias *a0 is not allowed" in a.line


def test_five_level_alias_bomb_is_one_short_line_not_the_expanded_value(tmp_path: Path) -> None:
    a = validate(write(tmp_path, alias_bomb(5)))
    assert a.code == 2 and "alias" in a.line and len(a.line) < 200


def test_any_alias_is_rejected_naming_its_key_path_and_line(tmp_path: Path) -> None:
    text = LOCAL + "  geotrain:policy:\n    allowed_gpu_types: &gpus [cpu]\n"
    text += "    encryption_required_for: *gpus\n"
    line = text.count("\n")
    a = validate(write(tmp_path, text))
    assert a.code == 2, a
    assert f"geotrain:policy.encryption_required_for: line {line}: YAML alias *gpus" in a.line
    assert "write the value out" in a.line


# -- big files ------------------------------------------------------------------------------


@pytest.mark.parametrize("mib", [5, 50])
def test_stack_file_over_1_mib_is_rejected_by_size_in_under_5_s(tmp_path: Path, mib: int) -> None:
    f = tmp_path / "Pulumi.big.yaml"
    with f.open("w") as out:
        out.write(LOCAL + "  geotrain:tags:\n")
        out.writelines(f"    tag{i:09d}: value\n" for i in range(mib * (1 << 20) // 24))
    a = validate_process(f, tmp_path)
    assert a.code == 2
    assert f"the file is {f.stat().st_size} bytes ({mib}.0 MiB)" in a.line
    assert "over the 1048576 byte (1 MiB) limit" in a.line


def test_densest_file_under_the_cap_hits_the_value_cap_in_under_5_s(tmp_path: Path) -> None:
    text = "config:\n  geotrain:tags: [" + "a," * ((yaml_safe.MAX_BYTES - 40) // 2) + "a]\n"
    a = validate_process(write(tmp_path, text), tmp_path)
    assert a.code == 2 and f"more than {yaml_safe.MAX_NODES} YAML values" in a.line


def test_realistic_file_at_the_cap_is_validated_in_under_5_s(tmp_path: Path) -> None:
    """~1 MiB of other providers' keys: every check runs on a full-size file, and passes."""
    text = LOCAL + "".join(f"  aws:key{i:08d}: value\n" for i in range(40_000))
    f = write(tmp_path, text)
    assert f.stat().st_size < yaml_safe.MAX_BYTES
    assert validate_process(f, tmp_path).code == 0


def test_libyaml_safe_loader_is_used_when_available() -> None:
    assert yaml.__with_libyaml__
    assert yaml_safe._Loader is yaml.CSafeLoader


def test_pure_python_loader_keeps_the_same_rules_without_libyaml(tmp_path: Path) -> None:
    """PyYAML built without libyaml: same answers (the fallback import) - aliases, depth."""
    deep = "config:\n  geotrain:tags: " + "[" * 600 + "]" * 600 + "\n"
    files = [write(tmp_path, alias_bomb(12), "a.yaml"), write(tmp_path, deep, "d.yaml")]
    code = (
        "import sys, yaml; del yaml.CSafeLoader; from infra.model import load_stack\n"
        "from training.errors import ConfigError\n"
        "for f in sys.argv[1:]:\n"
        "    try: load_stack(f)\n"
        "    except ConfigError as e: print(e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, files)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    alias, depth = r.stdout.splitlines()
    assert "YAML alias *a0 is not allowed" in alias
    assert "nested more than 32 levels deep" in depth


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1:30", "1:30"),  # YAML 1.1's base 60 (90): Pulumi reads a string
        ("12:00", "12:00"),
        ("1e3", 1000.0),  # an exponent without a dot: Pulumi reads a number
        ("2.5E-2", 0.025),
        ("017", 15),
        ("1_000", 1000),
        (".5", 0.5),
        ("10.42.0.0/16", "10.42.0.0/16"),
    ],
)
def test_numbers_read_as_pulumi_reads_them(tmp_path: Path, text: str, value: object) -> None:
    got = yaml_safe.read_yaml(write(tmp_path, f"a: {text}\n", "n.yaml"), "n.yaml")
    assert got == {"a": value} and type(got["a"]) is type(value)


# -- duplicate keys -------------------------------------------------------------------------


def test_duplicate_mapping_key_is_rejected_naming_key_path_and_line(tmp_path: Path) -> None:
    text = LOCAL.replace("      asn: 64602\n", "      asn: 64602\n      asn: 64609\n")
    a = validate(write(tmp_path, text))
    assert a.code == 2
    assert "geotrain:regions[1].asn: line 17: duplicate key 'asn' (first at line 16)" in a.line


@pytest.mark.parametrize(
    ("keys", "path"),
    [
        ("config:\n  a: 1\nconfig:\n  b: 2\n", "config: line 3"),
        ("config:\n  geotrain:tags: {1: a, 0x1: b}\n", "geotrain:tags.0x1: line 2"),
        ("config:\n  geotrain:tags: {yes: a, true: b}\n", "geotrain:tags.true: line 2"),
        ('config:\n  geotrain:tags: {owner: a, "owner": b}\n', "geotrain:tags.owner: line 2"),
    ],
    ids=["top-level", "same-int", "same-bool", "plain-and-quoted"],
)
def test_keys_that_load_to_the_same_value_are_duplicates(
    tmp_path: Path, keys: str, path: str
) -> None:
    a = validate(write(tmp_path, keys))
    assert a.code == 2 and path in a.line and "duplicate key" in a.line


# -- not a stack file -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stacks-dir", "Pulumi.dir.yaml"])
def test_directory_as_stack_path_is_reported_as_a_directory(tmp_path: Path, name: str) -> None:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "Pulumi.prod.yaml").write_text(LOCAL)
    a = validate(folder)
    assert a.code == 2
    assert "is a directory, not a stack file (it holds prod)" in a.line
    assert "no such stack file" not in a.line


def test_missing_stack_file_lists_the_available_stacks(tmp_path: Path) -> None:
    from infra.model import available_stacks

    a = validate(tmp_path / "Pulumi.nope.yaml")
    shipped = ", ".join(available_stacks())
    assert {"global", "lab", "local"} <= set(available_stacks())
    assert a.code == 2 and f"no such stack file; available stacks: {shipped}" in a.line


@pytest.mark.parametrize("text", ["", "\n\n  \n", "# only a comment\n", "---\n", "\ufeff"])
def test_empty_file_is_reported_as_empty(tmp_path: Path, text: str) -> None:
    a = validate(write(tmp_path, text))
    assert a.code == 2 and "the file is empty (or only comments)" in a.line


# -- echoed values stay short ---------------------------------------------------------------


def _set(old: str, new: str) -> str:
    assert old in LOCAL
    return LOCAL.replace(old, new)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (_set("owner: geotrain-dev", "owner: [" + "a, " * 5000 + "a]"), "tags.owner: Input"),
        (_set("name: beijing", "name: " + "x" * 5000), "regions[0].name: String should"),
        (_set("a: beijing, b: frankfurt", "a: " + "q" * 5000 + ", b: frankfurt"), "use one of"),
        (LOCAL + "  geotrain:" + "k" * 1000 + ": 1\n", "unknown key; allowed keys"),
        (_set("    steps: 40", "    " + "z" * 1000 + ": 40"), "unknown key 'zzzz"),
        (_set("owner: geotrain-dev", "owner: 0x" + "f" * 30000), "an integer of 120000 bits"),
        (_set("kind: local", "kind: " + "\\n" * 2000), "regions[0].pool.kind: Input"),
    ],
    ids=["long-list", "long-string", "checks-message", "long-key", "unknown-key", "huge-int", "nl"],
)
def test_every_echoed_value_is_cut_so_the_line_fits(tmp_path: Path, text: str, words: str) -> None:
    a = validate(write(tmp_path, text))  # `validate` asserts one line <= LINE_LIMIT
    assert a.code == 2 and words in a.line, a.line


# -- malformed input of every kind ----------------------------------------------------------

MALFORMED = [
    ("not-utf8", b"config:\n  geotrain:tags: {owner: \xff\xfe}\n", "line 2: not UTF-8 text"),
    ("nul-byte", "config:\n  geotrain:tags: {owner: a\x00b}\n", "line 2: invalid YAML: character"),
    ("top-level-list", "- config\n", "the top level is a list, not a mapping"),
    ("top-level-scalar", "42\n", "the top level is an integer, not a mapping"),
    ("no-config-key", "encryptionsalt: abc\n", "config: no 'config:' key"),
    ("config-empty", "config:\n", "config: 'config:' is empty"),
    ("config-not-mapping", "config: [a, b]\n", "config: 'config:' holds a list"),
    ("two-documents", "config: {}\n---\nconfig: {}\n", "a second YAML document"),
    ("complex-key", "config:\n  ? [a, b]\n  : c\n", "a list or mapping used as a key"),
    ("deep", "config:\n  geotrain:tags: " + "[" * 40 + "]" * 40, "nested more than 32 levels"),
    ("deeper-than-libyaml", "config: " + "[" * 5000 + "]" * 5000, "nested more than 32 levels"),
    ("syntax", "config:\n  geotrain:regions: [\n", "line 3, column 1: invalid YAML"),
    ("huge-int", LOCAL.replace("steps: 40", "steps: " + "9" * 5000), "integer of 5000 characters"),
    ("bad-date", LOCAL.replace("steps: 40", "steps: 2024-13-45"), "month must be in 1..12"),
    ("nan", LOCAL.replace("lr: 0.003", "lr: .nan"), "training.lr: Input should be greater"),
    ("inf", LOCAL.replace("latency_ms: 60", "latency_ms: .inf"), "links[0].latency_ms: Input"),
    ("inf-lr", LOCAL.replace("lr: 0.003", "lr: .inf"), "training.lr: inf is not a finite number"),
    (
        "huge-seed",
        LOCAL.replace("steps: 40", "steps: 40\n    seed: 0x" + "f" * 20_000),
        "training.seed: <an integer of 80000 bits> does not fit in 64 bits",
    ),
    (
        "nan-in-a-float-without-bounds",
        LOCAL.replace("sync: allreduce", "sync: diloco\n    diloco: {interval_minutes: .nan}"),
        "training.diloco.interval_minutes: nan is not a finite number",
    ),
    (
        "unicode-name",
        LOCAL.replace("name: beijing", "name: 北京"),
        "regions[0].name: String should",
    ),
    ("tab-in-key", LOCAL + '  "geotrain:ta\\tgs": 1\n', "geotrain:ta\\tgs: unknown key"),
    ("newline-in-key", LOCAL + '  "geotrain:x\\ny": 1\n', "geotrain:x\\ny: unknown key"),
    ("non-string-key", LOCAL.replace("  geotrain:tags:", "  geotrain:tags: {1: a}\n  x:"), "[key]"),
    ("unknown-tag", "config:\n  a: !python/object:os.system x\n", "could not determine a construc"),
]


@pytest.mark.parametrize(
    ("text", "words"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_stack_gets_one_clear_line(tmp_path: Path, text: str | bytes, words: str) -> None:
    a = validate(write(tmp_path, text))
    assert a.code == 2 and words in a.line, a.line
    assert "Pulumi.bad.yaml: " in a.line


@pytest.mark.parametrize(
    "text",
    [
        "\ufeff" + LOCAL,
        _set("    steps: 40\n", "    steps: 40\n    key_file: 北京/团队.key\n"),
        _set("    steps: 40\n", "    steps: 40\n    key_file: " + "x" * 100_000 + "\n"),
        LOCAL + "  aws:region: eu-central-1\n  1: 2\n  geotrain:sshPrivateKey: {secure: v1:a}\n",
    ],
    ids=["bom", "unicode-value", "long-value", "other-keys"],
)
def test_unusual_but_valid_stack_is_accepted(tmp_path: Path, text: str) -> None:
    assert validate(write(tmp_path, text)).code == 0
