"""The config tree: precedence, validation, and the CLI's handling of bad input."""

import argparse
import re
import tomllib

import pytest

from peerd.daemon.cli import build_parser
from peerd.daemon.config import OPTIONS, ConfigError, load_config
from tests.helpers import ROOT, peerd


def test_precedence_cli_over_env_over_file_over_default(tmp_path):
    f = tmp_path / "peerd.toml"
    f.write_text(
        'log_level = "debug"\nmetrics_port = 2222\n[network]\nport = 1111\nhost = "127.0.0.1"\n[discovery]\npeer_ttl = 12.0\n'
    )
    env = {"PEERD_PORT": "3333", "PEERD_METRICS_PORT": "4444", "PEERD_RUN": "x,y"}
    c = load_config({"network.port": "5555"}, config_file=str(f), environ=env)
    assert c.network.port == 5555  # CLI beats env and file
    assert c.metrics_port == 4444  # env beats file
    assert c.network.host == "127.0.0.1" and c.discovery.peer_ttl == 12.0  # file beats default
    assert c.log_level == "DEBUG"
    assert c.run == ["x", "y"]
    assert c.discovery.heartbeat_interval == 2.0  # default


@pytest.mark.parametrize(
    "cli,message",
    [
        ({"network.port": "70000"}, "not a TCP port"),
        ({"network.port": "abc"}, "expected an integer"),
        ({"run": ["bad run"]}, "run ID"),
        ({"discovery.peer_ttl": "1"}, "at least twice"),
        ({"network.host": "example.com"}, "not an IP address"),
        ({"network.initial_peers": ["127.0.0.1:4000"]}, "not a multiaddr"),
        ({"network.data_path": "carrier-pigeon"}, "not one of auto, reliable, udp"),
        ({"network.reliable_links": "reliable"}, "not one of auto, tcp, libp2p"),
        ({"discovery.peer_ttl": "4"}, "at most half of peer_ttl"),
        ({"train.train_processes": "0"}, "train_processes must be in 1..64"),
        ({"train.local_group_host": "rack7.lan"}, "local_group_host must be an IP address"),
    ],
)
def test_bad_values(cli, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cli, environ={})


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[network]\nprot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting.*network.prot"):
        load_config({}, config_file=str(f), environ={})


@pytest.mark.parametrize(
    "args",
    [
        ["start", "--port", "x"],
        ["start", "--no-such-flag"],
        ["start", "--run", "bad/id"],
    ],
)
def test_cli_bad_flag_is_one_line_and_exit_2(args, tmp_path):
    r = peerd(*args, "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()  # nothing was created


def test_cli_broken_config_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("[network\nport = ")
    r = peerd("start", "--config", str(f), "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "broken.toml" in r.stderr, r.stderr


def test_client_without_daemon_is_a_clear_error(tmp_path):
    r = peerd("status", "--data-dir", str(tmp_path))
    assert r.returncode == 1 and "no daemon answering" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_help_lists_every_subcommand():
    r = peerd("--help")
    for sub in ("start", "status", "peers", "join", "leave", "stop", "health"):
        assert sub in r.stdout
    for sub in ("start", "status", "peers", "join", "leave", "stop", "health"):
        assert peerd(sub, "--help").returncode == 0


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:http", "127.0.0.1:70000", ":9000", "unix:"])
def test_malformed_control_address(address):
    with pytest.raises(ConfigError, match="neither unix:PATH nor HOST:PORT"):
        load_config({"control": address}, environ={})


@pytest.mark.parametrize("case", ["missing", "empty", "directory", "control", "long-socket"])
def test_cli_bad_secret_file_or_control_address_is_one_line_and_exit_2(case, tmp_path):
    """Checked before anything starts: the data dir is not even created."""
    secret = tmp_path / "run.secret"
    if case == "empty":
        secret.write_text("")
    elif case == "directory":
        secret.mkdir()
    bad = ["--run-secret-file", str(secret)]
    if case == "control":
        bad = ["--control", "localhost"]
    elif case == "long-socket":  # a unix socket path longer than sun_path: bind() would fail after p2pd started
        bad = ["--control", f"unix:{tmp_path / ('s' * 120)}"]
    r = peerd("start", "--data-dir", str(tmp_path / "d"), "--port", "0", "--metrics-port", "0", *bad)
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert ("control" if case in ("control", "long-socket") else str(secret)) in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()


def _start_options(argv: list[str]) -> dict:
    """What `peerd start ARGV` hands load_config: only the options that were typed."""
    args = build_parser().parse_args(["start", *argv])
    return {o.path: getattr(args, o.path) for o in OPTIONS if hasattr(args, o.path)}


def test_no_flag_overrides_a_true_from_the_environment():
    env = {"PEERD_NAT_PORT_MAP": "true", "PEERD_AUTO_NAT": "yes"}
    assert _start_options([]) == {}
    c = load_config(_start_options(["--no-nat-port-map"]), environ=env)
    assert (c.network.nat_port_map, c.network.auto_nat) == (False, True)
    c = load_config(_start_options(["--nat-port-map", "--no-auto-nat"]), environ={})
    assert (c.network.nat_port_map, c.network.auto_nat) == (True, False)


def test_start_help_shows_every_default():
    start = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["start"]
    helps = {flag: a.help for a in start._actions for flag in a.option_strings}
    for o in OPTIONS:
        assert "(default: " in helps[o.flag], o.flag
    assert "(default: 10.0)" in helps["--peer-ttl"] and "(default: 31337)" in helps["--port"]
    assert "(default: off)" in helps["--nat-port-map"] and "(default: none)" in helps["--run"]
    r = peerd("start", "--help")
    assert r.returncode == 0 and "(default: 9400)" in " ".join(r.stdout.split()), r


def test_the_complete_file_in_the_docs_is_complete_and_loads(tmp_path):
    text = (ROOT / "docs" / "operations.md").read_text()
    (example,) = re.findall(r"A complete file.*?```toml\n(.*?)```", text, re.S)
    keys = set()
    for key, value in tomllib.loads(example).items():
        keys |= {f"{key}.{sub}" for sub in value} if isinstance(value, dict) else {key}
    assert keys == {o.path for o in OPTIONS}
    f = tmp_path / "peerd.toml"
    f.write_text(example)
    c = load_config({}, config_file=str(f), environ={})
    assert c.run == ["demo"] and c.train.checkpoint_every == 100


def test_every_flag_is_its_leaf_in_the_tree():
    for o in OPTIONS:
        assert o.flag == "--" + o.path.rpartition(".")[2].replace("_", "-"), o
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)


@pytest.mark.parametrize(
    "where,message",
    [
        ({"PEERD_TRANSPORT": "udp"}, "PEERD_TRANSPORT is now PEERD_DATA_PATH"),
        ({"PEERD_UDP_RATE": "10"}, "PEERD_UDP_RATE is now PEERD_UDP_RATE_MBIT"),
        ("[network]\ntransport = 'udp'\n", r"\[network\] transport is now \[network\] data_path"),
        ("[metrics]\nport = 9400\n", r"\[metrics\] port is now metrics_port"),
        ("runs = ['a']\n", "runs is now run"),
        ("[train]\nthreads = 2\n", r"\[train\] threads is now \[train\] torch_threads"),
    ],
)
def test_a_renamed_setting_is_refused_naming_the_new_one(where, message, tmp_path):
    """Settings renamed after peerd 0.1.0 (variables and TOML keys): one line naming the new name."""
    f = tmp_path / "c.toml"
    f.write_text(where if isinstance(where, str) else "")
    with pytest.raises(ConfigError, match=message):
        load_config({}, config_file=str(f), environ=where if isinstance(where, dict) else {})


@pytest.mark.parametrize("old,new", [("--transport", "--data-path"), ("--udp-rate", "--udp-rate-mbit")])
def test_a_renamed_flag_is_one_line_naming_the_new_one(old, new, tmp_path):
    r = peerd("start", "--data-dir", str(tmp_path / "d"), old, "1")
    assert r.returncode == 2 and f"{old} is now {new}" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "d").exists()


def test_a_bad_value_is_named_as_the_user_typed_it(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[network]\nport = true\n")
    cases = [
        ({"cli": {"network.port": "abc"}}, "--port: expected an integer, got 'abc'"),
        ({"environ": {"PEERD_UDP_RATE_MBIT": "fast"}}, "PEERD_UDP_RATE_MBIT: expected a number, got 'fast'"),
        ({"config_file": str(f)}, r"c.toml: \[network\] port: expected an integer, got True"),
    ]
    for kw, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(kw.get("cli", {}), config_file=kw.get("config_file"), environ=kw.get("environ", {}))


@pytest.mark.parametrize(
    "where",
    [{"PEERD_TRAIN_PROCESS": "false"}, "[train]\ntrain_process = false\n"],
)
def test_a_removed_setting_is_refused_saying_why(where, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(where if isinstance(where, str) else "")
    with pytest.raises(
        ConfigError, match="(train_process|TRAIN_PROCESS) is removed: every --task run trains in child processes"
    ):
        load_config({}, config_file=str(f), environ=where if isinstance(where, dict) else {})


@pytest.mark.parametrize("flag", ["--train-process", "--no-train-process"])
def test_a_removed_flag_is_one_line_saying_why(flag, tmp_path):
    r = peerd("start", "--data-dir", str(tmp_path / "d"), flag)
    assert r.returncode == 2 and f"{flag} is removed: every --task run trains in child processes" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "d").exists()
