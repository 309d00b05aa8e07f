from __future__ import annotations

from pathlib import Path

import pytest

from services.config.loading import ConfigError, load_settings


def test_defaults_are_the_embedded_broker_and_store() -> None:
    settings = load_settings(None, {})
    assert settings.broker.kind == "memory"
    assert settings.store.kind == "memory"


def test_toml_file_then_environment_override(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[broker]\nkind = "rabbitmq"\namqp_url = "amqp://a:b@h:1/%2F"\n'
        '[store]\nkind = "redis"\nkeep_versions = 3\n'
    )
    settings = load_settings(path, {})
    assert settings.broker.amqp_url == "amqp://a:b@h:1/%2F"
    assert settings.store.keep_versions == 3

    env = {
        "SPLITMQ_AMQP_URL": "amqp://x:y@z:2/%2F",
        "SPLITMQ_STORE__KEEP_VERSIONS": "7",
        "SPLITMQ_BROKER__TLS__CA_FILE": "/ca.pem",
        "SPLITMQ_TEST_DATA_DIR": "/ignored/unrelated/variable",
        "HOME": "/root",
    }
    settings = load_settings(path, env)
    assert settings.broker.amqp_url == "amqp://x:y@z:2/%2F"
    assert settings.broker.kind == "rabbitmq"
    assert settings.store.keep_versions == 7
    assert settings.broker.tls.ca_file == "/ca.pem"


def test_invalid_values_name_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[store]\nkeep_versions = 0\n[broker]\nkind = "kafka"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    text = str(info.value)
    assert "store.keep_versions" in text
    assert "broker.kind" in text


def test_unknown_keys_in_the_file_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[broker]\namqp_ulr = 'typo'\n")
    with pytest.raises(ConfigError, match="amqp_ulr"):
        load_settings(path, {})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml", {})
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad, {})


def test_a_cluster_is_a_list_of_nodes_and_gets_quorum_queues(tmp_path: Path) -> None:
    nodes = [f"amqp://u:p@127.0.0.1:{port}/%2F" for port in (5701, 5702, 5703)]
    path = tmp_path / "c.toml"
    path.write_text(f'[broker]\nkind = "rabbitmq"\namqp_urls = {nodes!r}\n'.replace("'", '"'))
    broker = load_settings(path, {}).broker
    assert broker.urls == tuple(nodes)
    assert broker.amqp_url == nodes[0]  # whose user and vhost the roles' identities use
    assert broker.quorum  # auto: more than one node

    from_env = load_settings(None, {"SPLITMQ_AMQP_URLS": " , ".join(nodes[:2])}).broker
    assert from_env.urls == tuple(nodes[:2]) and from_env.quorum
    one = load_settings(None, {"SPLITMQ_AMQP_URLS": nodes[0]}).broker
    assert one.urls == (nodes[0],) and not one.quorum
    forced = load_settings(None, {"SPLITMQ_BROKER__QUEUE_TYPE": "quorum"}).broker
    assert forced.quorum and forced.urls == (forced.amqp_url,)
    classic = {"SPLITMQ_AMQP_URLS": ",".join(nodes), "SPLITMQ_BROKER__QUEUE_TYPE": "classic"}
    assert not load_settings(None, classic).broker.quorum

    with pytest.raises(ConfigError, match=r"amqp_url is not one of broker\.amqp_urls"):
        load_settings(path, {"SPLITMQ_AMQP_URL": "amqp://u:p@elsewhere:5672/%2F"})


@pytest.mark.parametrize(
    ("toml", "line"),
    [
        (
            "[algorithm]\nbatch_szie = 3\n",
            "algorithm.batch_szie: Extra inputs are not permitted: did you mean batch_size?",
        ),
        ("[job]\nrunds = 2\n", "job.runds: Extra inputs are not permitted: did you mean rounds?"),
        (
            '[broker]\namqp_ulr = "x"\n',
            "broker.amqp_ulr: Extra inputs are not permitted: did you mean amqp_url?",
        ),
        ("jbo = 1\n", "jbo: Extra inputs are not permitted: did you mean job?"),
        (
            "[data]\nbatch_size = 3\n",
            "data.batch_size: Extra inputs are not permitted: batch_size belongs in [algorithm]",
        ),
        (
            '[algorithm]\nname = "splitgp"\n[algorithm.splitgp]\ngamam = 1\n',
            "algorithm.splitgp.gamam: Extra inputs are not permitted: did you mean gamma?",
        ),
        (
            "[algorithm.splitgpp]\nx = 1\n",
            "algorithm.splitgpp: no algorithm has such a parameter section: did you mean splitgp?",
        ),
    ],
)
def test_a_typo_gets_the_nearest_key(tmp_path: Path, toml: str, line: str) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert f"  {line}" in str(info.value).splitlines()


def test_no_hint_when_nothing_is_close(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[clients]\nzzzzzz = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert str(info.value).splitlines()[1] == "  clients.zzzzzz: Extra inputs are not permitted"


def test_load_settings_takes_a_path_name_and_no_environment(tmp_path: Path) -> None:
    """From a notebook: `load_settings("job.toml")`, no Path and no env mapping needed."""
    from services.config.loading import load_settings

    path = tmp_path / "job.toml"
    path.write_text('[job]\nname = "notebook"\n')
    assert load_settings(str(path)).job.name == "notebook"
    assert load_settings(path, {"SPLITMQ_JOB__NAME": "from-env"}).job.name == "from-env"


def test_the_environment_sets_the_recipes_keyword_arguments_as_toml_values() -> None:
    # [optimizer] takes any keyword argument of the class it names; these once went nowhere.
    env = {
        "SPLITMQ_OPTIMIZER__NAME": "adamw",
        "SPLITMQ_OPTIMIZER__LR": "0.5",
        "SPLITMQ_OPTIMIZER__BETAS": "[0.8, 0.9]",
        "SPLITMQ_OPTIMIZER__AMSGRAD": "true",
        "SPLITMQ_SCHEDULE__NAME": "steplr",
        "SPLITMQ_SCHEDULE__STEP_SIZE": "3",
    }
    settings = load_settings(None, env)
    assert settings.optimizer.arguments() == {"lr": 0.5, "betas": (0.8, 0.9), "amsgrad": True}
    assert settings.schedule.arguments() == {"step_size": 3}


def test_a_misspelt_variable_under_a_known_section_is_named_with_the_nearest_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="splitmq.config"):
        settings = load_settings(None, {"SPLITMQ_CLIENTS__COUNTT": "3", "SPLITMQ_DATA_DIR": "x"})
    assert settings.clients.count == load_settings(None).clients.count
    # Only the one under a section: SPLITMQ_DATA_DIR is another program's variable.
    assert caplog.messages == [
        "SPLITMQ_CLIENTS__COUNTT is ignored: clients.countt is no setting: did you mean count?"
    ]
