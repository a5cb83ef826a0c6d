"""The CLI: commands work on every stack; bad input is one line and exit code 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from geotrain.cli import cli
from infra import tokens


@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_validate_render_graph_work_for_every_stack(stack: str, tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["validate", "--stack", stack]).exit_code == 0
    r = runner.invoke(cli, ["render", "--stack", stack, "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "launch-spec.json").is_file()
    if stack != "local":  # hosts that run the agent get a complete bundle each
        assert all((b / "manifest.json").is_file() for b in (tmp_path / "bundles").iterdir())
    g = runner.invoke(cli, ["graph", "--stack", stack])
    assert g.exit_code == 0, g.output
    for token in tokens.ALL:
        assert token in g.output


def test_graph_global_lists_per_region_resources() -> None:
    out = CliRunner().invoke(cli, ["graph", "--stack", "global"]).output
    for region in ("beijing", "frankfurt", "silicon-valley"):
        assert f"{region}-pool" in out
    assert "beijing-pool-bj-3-bundle" in out  # each host's bundle copy
    assert "overlay-bj-0-wgkey" in out  # gateways make their WireGuard keys
    assert "training-sv-7-agent" in out  # the agent on every host
    assert "training-run-key" in out


def test_broken_stack_is_one_line_exit_2(write_stack: Any) -> None:
    f = write_stack("local", lambda c: c["geotrain:regions"][1].__setitem__("asn", 64601))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and "duplicate ASN" in lines[0] and "Traceback" not in r.output


@pytest.mark.parametrize(
    ("steps", "words"),
    [
        ("0", "0: a run has at least 1 step"),
        ("-5", "-5: a run has at least 1 step"),
        ("3", "warmup_steps: 5 must be < training.steps (3)"),
    ],
)
def test_train_steps_is_checked_with_the_stack_before_fresh_deletes_anything(
    write_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: str, words: str
) -> None:
    def warmup(c: dict[str, Any]) -> None:
        c["geotrain:training"].update(sync="diloco", diloco={"inner_steps": 4, "warmup_steps": 5})

    f = write_stack("local", warmup)
    monkeypatch.chdir(tmp_path)
    step = tmp_path / ".geotrain" / "broken" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    r = CliRunner().invoke(cli, ["train", "--stack", str(f), "--fresh", "--steps", steps])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and words in lines[0] and "--steps" in lines[0], r.output
    assert step.is_dir()  # --fresh never ran


@pytest.mark.parametrize(
    "ckpt", ["", ".", "./", "..", "{node}/..", "/", "/etc", "/usr/lib/ckpt", "/home", "~/ckpt"]
)
def test_a_checkpoint_dir_that_is_not_a_directory_of_its_own_is_refused(
    write_stack: Any, ckpt: str
) -> None:
    f = write_stack("global", lambda c: c["geotrain:training"]["checkpoint"].update(dir=ckpt))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and "training.checkpoint.dir" in lines[0], r.output
    assert "a directory of its own" in lines[0] and "Traceback" not in r.output


@pytest.mark.parametrize(
    "ckpt", ["/home/{node}/ckpt", "/var/lib/geotrain/ckpt", "{node}", "/data/ckpt/{region}"]
)
def test_a_checkpoint_dir_of_its_own_is_accepted(write_stack: Any, ckpt: str) -> None:
    f = write_stack("global", lambda c: c["geotrain:training"]["checkpoint"].update(dir=ckpt))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    ("key", "value", "path"),
    [
        ("steps", True, "training.steps"),
        ("bucket_mb", True, "training.bucket_mb"),
        ("compression", {"quantize": "int8", "zstd_level": False}, "compression.zstd_level"),
        ("diloco", {"inner_steps": True}, "diloco.inner_steps"),
        ("diloco", {"outer_lr": True}, "diloco.outer_lr"),
        ("checkpoint", {"interval_minutes": True}, "checkpoint.interval_minutes"),
    ],
)
def test_a_boolean_where_a_number_goes_is_refused(
    write_stack: Any, key: str, value: Any, path: str
) -> None:
    def put(c: dict[str, Any]) -> None:
        c["geotrain:training"].update({key: value}, sync="diloco")

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("local", put))])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and path in lines[0] and "where a number goes" in lines[0], r.output


def test_booleans_stay_fine_where_booleans_go(write_stack: Any) -> None:
    def put(c: dict[str, Any]) -> None:
        c["geotrain:training"]["compression"]["error_feedback"] = False
        c["geotrain:training"]["checkpoint"]["keep_on_destroy"] = False

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("local", put))])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    ("training", "words"),
    [
        ({"sync": "diloco", "diloco": {"inner_steps": 10, "mix": 0.5}}, "mix 0.5 has no effect"),
        ({"sync": "allreduce", "diloco": {"inner_steps": 10}}, "does not use it"),
        ({"steps": 20, "checkpoint": {"interval_steps": 20}}, "saves no checkpoint"),
        ({"sync": "diloco", "steps": 40}, "inner_steps 100 is not below the 40 steps"),
        (
            {"sync": "diloco", "steps": 40, "diloco": {"inner_steps": 30, "warmup_steps": 10}},
            "merge once, at the end",
        ),
        (
            {
                "sync": "diloco",
                "steps": 40,
                "diloco": {"inner_steps": 100, "inner_steps_start": 50},
            },
            "inner_steps_start 50 is not below the 40 steps",
        ),
        (
            {"fault_tolerance": {"lighthouse": "beijing", "min_replicas": 3}},
            "losing any region stops the others",
        ),
    ],
)
def test_validate_names_settings_the_run_will_not_use(
    write_stack: Any, training: dict[str, Any], words: str
) -> None:
    f = write_stack("local", lambda c: c["geotrain:training"].update(training))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 0 and "hint: training." in r.output and words in r.output, r.output


def test_a_ramp_that_merges_before_the_end_gets_no_one_merge_hint(write_stack: Any) -> None:
    d = {"inner_steps": 100, "inner_steps_start": 5}  # rounds of 5, 10, 20: 3 merges in 40
    f = write_stack("local", _upd("training", sync="diloco", steps=40, diloco=d))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 0 and "merge once" not in r.output, r.output


def test_validate_gives_no_idle_setting_hints_for_the_shipped_stacks() -> None:
    for stack in ("local", "lab", "global", "k8s", "global-cloud"):
        r = CliRunner().invoke(cli, ["validate", "--stack", stack])
        assert r.exit_code == 0 and "hint:" not in r.output, (stack, r.output)


def _regions(c: dict[str, Any]) -> list[dict[str, Any]]:
    regions: list[dict[str, Any]] = c["geotrain:regions"]
    return regions


def _upd(section: str, **values: Any) -> Any:
    return lambda c: c[f"geotrain:{section}"].update(values)


def _fewer_shards(c: dict[str, Any]) -> None:
    c["geotrain:training"]["data_shards"] = c["geotrain:training"]["data_shards"][1:]


BREAKS_HOSTS = [
    ("global", _upd("training", key_file="/etc/passwd"), "training.key_file", "system files"),
    ("global", _upd("training", key_file="/etc/geotrain/firewall.nft"), "key_file", "agent's"),
    ("global", _upd("training", key_file=""), "key_file", "empty"),
    ("global", lambda c: _regions(c)[2]["pool"].update(ssh={"user": "r;x"}), "ssh.user", ""),
    ("global-cloud", lambda c: _regions(c)[0]["pool"].update(ssh={"port": 2}), "ssh.port", "22"),
    ("global", _fewer_shards, "training.data_shards", "has no data shard"),
    ("global", _upd("training", rendezvous_port=9100), "rendezvous_port", "node_exporter"),
    ("global", _upd("monitoring", bind_address="10.9.9.9"), "bind_address", "cannot share"),
    ("global", _upd("monitoring", bind_address="127.0.0.1"), "bind_address", "cannot scrape"),
    ("global", _upd("tags", owner="ml-platform\n"), "tags", ""),
]


@pytest.mark.parametrize(("base", "mutate", "path", "words"), BREAKS_HOSTS)
def test_settings_that_would_break_hosts_are_refused(
    write_stack: Any, base: str, mutate: Any, path: str, words: str
) -> None:
    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack(base, mutate))])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and path in lines[0] and words in lines[0], r.output


@pytest.mark.parametrize(
    ("name", "stack"),
    [
        ("Pulumi.global.yml", "global"),  # .yml: the whole name, not one character less
        ("Pulumi.ok_1.yaml", "ok_1"),
        ("Pulumi....yaml", None),  # '..': every path built from it would climb out
        ("Pulumi.a b.yaml", None),
        ("Pulumi.x\nExecStartPre=touch pwned.yaml", None),
    ],
)
def test_the_stack_name_from_the_file_name_is_checked(
    tmp_path: Path, name: str, stack: str | None
) -> None:
    from tests.conftest import stack_doc

    f = tmp_path / name
    f.write_text(yaml.safe_dump(stack_doc("global")))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    if stack is None:
        assert r.exit_code == 2 and "stack name" in r.output, r.output
    else:
        assert r.exit_code == 0 and r.output.startswith(f"{stack}: ok"), r.output


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"network-integrity": "Mandatory"}', "enforcement level 'Mandatory'"),
        ('{"budget-cap": {"maxGPUs": 1}}', "unknown setting; settings here: maxGpus"),
        ('{"budget-cap": {"maxGpus": "lots"}}', "'lots' is not number"),
        ('{"no-such-policy": "advisory"}', "unknown policy"),
        ("[1]", "a JSON object"),
        ("not json", "cannot read it as JSON"),
    ],
)
def test_a_policy_config_the_engine_would_refuse_is_one_line(
    tmp_path: Path, text: str, words: str
) -> None:
    f = tmp_path / "policy.json"
    f.write_text(text)
    r = CliRunner().invoke(cli, ["check", "--stack", "global", "--policy-config", str(f)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.output, r.output


def test_output_paths_that_cannot_be_written_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    runner = CliRunner()
    cases = [
        (["keygen", "--out", str(tmp_path / "afile" / "x")], "cannot create key file"),
        (["keygen", "--out", str(tmp_path / "dangling")], "symlink to a missing file"),
        (["render", "--stack", "local", "--out", str(tmp_path / "afile" / "o")], "cannot write"),
        (["launch", "--spec", str(tmp_path / "bin.json"), "--node", "x"], "not UTF-8 text"),
        (["top", "--stack", "local", "--interval", "nan"], "not a number of seconds"),
        (["top", "--stack", "local", "--interval", "-1"], "not in the range"),
    ]
    for args, words in cases:
        r = runner.invoke(cli, args)
        assert r.exit_code == 2 and words in r.output, (args, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)
    assert (tmp_path / "afile").read_text() == "mine"


def test_render_never_deletes_a_directory_it_did_not_write(tmp_path: Path) -> None:
    """--out's bundles/<node> is replaced only when it holds a bundle: someone's notes
    there stop the render, and a second render replaces the first one's bundles."""
    runner = CliRunner()
    assert runner.invoke(cli, ["render", "--stack", "lab", "--out", str(tmp_path)]).exit_code == 0
    again = runner.invoke(cli, ["render", "--stack", "lab", "--out", str(tmp_path)])
    assert again.exit_code == 0, again.output
    notes = tmp_path / "bundles" / "bj-gw"
    import shutil

    shutil.rmtree(notes)
    (notes / "notes").mkdir(parents=True)
    (notes / "notes" / "todo.txt").write_text("keep")
    r = runner.invoke(cli, ["render", "--stack", "lab", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no bundle manifest" in r.output, r.output
    assert (notes / "notes" / "todo.txt").read_text() == "keep"


def test_a_second_render_removes_what_the_first_wrote_for_a_dropped_node_and_nothing_else(
    tmp_path: Path, write_stack: Any
) -> None:
    """Rendering a stack without bj-7 into the directory of one with it leaves no bj-7
    bundle (with the old run id) to apply by mistake; the user's own files stay."""
    runner = CliRunner()
    out = tmp_path / "out"
    r = runner.invoke(cli, ["render", "--stack", "global", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "bundles" / "bj-7").is_dir() and any((out / "nodes" / "bj-7").iterdir())
    (out / "nodes" / "mine.txt").write_text("keep")
    (out / "bundles" / "notes").mkdir()

    def drop(c: dict[str, Any]) -> None:
        bj = c["geotrain:regions"][0]["pool"]["nodes"]
        c["geotrain:regions"][0]["pool"]["nodes"] = [n for n in bj if n["name"] != "bj-7"]

    r = runner.invoke(
        cli, ["render", "--stack", str(write_stack("global", drop)), "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "removed" in r.output and "bundles/bj-7" in r.output
    assert not (out / "bundles" / "bj-7").exists() and not (out / "nodes" / "bj-7").exists()
    assert (out / "bundles" / "bj-6").is_dir()
    assert (out / "nodes" / "mine.txt").read_text() == "keep" and (
        out / "bundles" / "notes"
    ).is_dir()
    record = (out / ".geotrain-render.json").read_text()
    (out / ".geotrain-render.json").write_text(record.replace('"files": [', '"files": ["../x", '))
    (tmp_path / "x").write_text("outside")
    assert runner.invoke(cli, ["render", "--stack", "global", "--out", str(out)]).exit_code == 0
    assert (tmp_path / "x").read_text() == "outside"  # a record never reaches outside --out
    (tmp_path / "manifest.json").write_text("{}")  # what a bundle dir holds, one level up
    (out / "bundles" / "bj-9").mkdir()
    (out / "bundles" / "bj-9" / "manifest.json").write_text("{}")
    for record in (
        '{"files": [], "bundles": ["../..", "..", "bj-9/../.."]}',
        '{"files": "ab", "bundles": []}',
        '["files"]',
    ):
        (out / ".geotrain-render.json").write_text(record)
        (out / "a").write_text("mine")
        r = runner.invoke(cli, ["render", "--stack", "global", "--out", str(out)])
        assert r.exit_code == 0 and "removed" not in r.output, (record, r.output)
        assert (out / "a").read_text() == "mine" and (tmp_path / "manifest.json").exists()
        assert (out / "bundles" / "bj-9" / "manifest.json").exists()  # not in a valid record


def test_render_refuses_an_empty_out() -> None:
    r = CliRunner().invoke(cli, ["render", "--stack", "local", "--out", " "])
    assert r.exit_code == 2 and "--out" in r.output and "is empty" in r.output, r.output


def test_links_that_leave_a_region_unreachable_are_refused(write_stack: Any) -> None:
    def cut(c: dict[str, Any]) -> None:
        c["geotrain:network"]["links"] = [
            x for x in c["geotrain:network"]["links"] if "silicon-valley" not in (x["a"], x["b"])
        ]

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("global", cut))])
    assert r.exit_code == 2 and "no path of links from beijing to silicon-valley" in r.output


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("gpu_prices", {"A100-80GB": -100}),  # a negative price passed the budget cap
        ("min_checkpoint_keep", -1),
        ("max_checkpoint_interval_minutes", -5),
        ("required_tags", [""]),
    ],
)
def test_policy_settings_out_of_their_range_are_refused(
    write_stack: Any, key: str, value: Any
) -> None:
    f = write_stack("global", lambda c: c.setdefault("geotrain:policy", {}).update({key: value}))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2 and f"policy.{key}" in r.output, r.output


@pytest.mark.parametrize("uri", ["file:", "file:.", "pydoc-topics:nonsense"])
def test_a_shard_uri_that_names_no_data_of_its_own_is_refused(write_stack: Any, uri: str) -> None:
    f = write_stack("local", lambda c: c["geotrain:training"]["data_shards"][0].update(uri=uri))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2 and "data_shards[0].uri" in r.output, r.output


def test_validate_names_pool_settings_the_pool_kind_does_not_use(write_stack: Any) -> None:
    def put(c: dict[str, Any]) -> None:
        c["geotrain:regions"][1]["pool"]["kubernetes"] = {"namespace": "ml"}

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("global", put))])
    assert r.exit_code == 0, r.output
    assert "hint: regions[1].pool.kubernetes is set but pools of kind ssh do not use it" in r.output


@pytest.mark.parametrize("address", ["0.0.0.0", "255.255.255.255", "224.0.0.1"])
def test_a_node_address_no_host_has_is_refused(write_stack: Any, address: str) -> None:
    f = write_stack("global", lambda c: _regions(c)[0]["pool"]["nodes"][1].update(address=address))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2 and "is not a host's address" in r.output, r.output


@pytest.mark.parametrize("cidr", ["127.0.0.0/16", "224.0.0.0/16"])
def test_an_overlay_hosts_do_not_route_is_refused(write_stack: Any, cidr: str) -> None:
    r = CliRunner().invoke(
        cli, ["validate", "--stack", str(write_stack("global", _upd("network", overlay_cidr=cidr)))]
    )
    assert r.exit_code == 2 and "network.overlay_cidr" in r.output, r.output


def test_a_lost_run_key_with_checkpoints_left_stops_before_training_from_step_0(
    write_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new key would verify none of the checkpoints: every one would be quarantined and
    the run would start over from step 0 without a word."""
    f = write_stack("local", name="keyless")
    monkeypatch.chdir(tmp_path)
    step = tmp_path / ".geotrain/keyless/checkpoints/step-20/bj-0"
    step.mkdir(parents=True)
    r = CliRunner().invoke(cli, ["train", "--stack", str(f)])
    assert r.exit_code == 2 and "run key .geotrain/keyless/run.key is gone" in r.output, r.output
    assert "--fresh" in r.output and step.is_dir()
    assert not (tmp_path / ".geotrain/keyless/run.key").exists()  # no new key made


def test_fresh_forgets_the_high_water_records_even_when_the_root_keeps_other_files(
    write_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root on its own disk keeps lost+found after --fresh: the run dir's high-water
    records must go too, or the next resume calls the emptied root a rollback."""
    from geotrain.commands import prepare_local_run
    from infra.model import load_stack

    f = write_stack("local", name="fresh")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / ".geotrain/fresh"
    (run / "checkpoints/lost+found").mkdir(parents=True)
    (run / "checkpoints/step-20/bj-0").mkdir(parents=True)
    (run / "high-water-bj-0.json").write_text("{}")
    prepare_local_run(load_stack(str(f)), fresh=True)
    assert not (run / "high-water-bj-0.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["lost+found"]


def test_fresh_deletes_no_root_when_one_of_them_is_another_stacks(
    write_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from geotrain.commands import prepare_local_run
    from infra.model import load_stack
    from training.errors import CheckpointError

    def per_node(c: dict[str, Any]) -> None:
        c["geotrain:training"]["checkpoint"]["dir"] = "ckpt/{node}"

    f = write_stack("local", per_node, name="both")
    monkeypatch.chdir(tmp_path)
    for node in ("bj-0", "fra-0"):
        (tmp_path / "ckpt" / node / "step-3" / node).mkdir(parents=True)
    (tmp_path / "ckpt" / "fra-0" / "STACK").write_text("other\n")
    with pytest.raises(CheckpointError, match="holds stack other's"):
        prepare_local_run(load_stack(str(f)), fresh=True)
    assert (tmp_path / "ckpt/bj-0/step-3").is_dir()  # all or none: bj-0's stayed too
