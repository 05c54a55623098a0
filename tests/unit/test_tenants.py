"""Who a client is (services.gateway.tenants): keys from --api-key, VLLM_API_KEY and a keys file,
resolved to a tenant by vLLM's bearer rule, reloaded in one swap, and never shown."""

from __future__ import annotations

import json
import logging

import pytest

from services.cli import build_parser, load_tenants
from services.common.config import from_args
from services.gateway.config import GatewayConfig
from services.gateway.tenants import ANONYMOUS, DEFAULT, Tenant, Tenants

pytestmark = pytest.mark.unit

SECRET = "sk-do-not-print-0123456789"


def keys_file(tmp_path, *lines, name="keys.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return str(path)


def test_without_keys_every_request_is_anonymous_whatever_it_carries():
    tenants = Tenants()
    assert not tenants.required
    for value in (None, "", "Bearer x", "Basic y"):
        assert tenants.identify(value) == Tenant(ANONYMOUS)


@pytest.mark.parametrize("value,ok", [
    ("Bearer k1", True), ("bearer k2", True), ("BEARER k1", True),
    (None, False), ("", False), ("Bearer", False), ("Bearer ", False), ("Bearer k3", False),
    ("Basic k1", False), ("Bearerk1", False), ("Bearer  k1", False), ("k1", False),
])
def test_a_bearer_key_names_its_tenant_as_vllm_reads_the_header(value, ok):
    tenants = Tenants(["k1", "k2"])
    assert tenants.identify(value) == (Tenant(DEFAULT) if ok else None)


def test_api_key_wins_over_vllm_api_key_which_is_used_without_it():
    env = {"VLLM_API_KEY": "from-env"}
    both = Tenants.from_config(GatewayConfig(lms="l:1", api_key=["from-flag"]), env)
    assert both.identify("Bearer from-flag") and both.identify("Bearer from-env") is None
    env_only = Tenants.from_config(GatewayConfig(lms="l:1"), env)
    assert env_only.identify("Bearer from-env") == Tenant(DEFAULT)
    assert not Tenants.from_config(GatewayConfig(lms="l:1"), {"VLLM_API_KEY": ""}).required


def test_api_key_takes_several_space_separated_keys_and_keeps_commas_as_vllm_does():
    ns = build_parser().parse_args(["gateway", "--lms", "l:1", "--api-key", "a,b", "c"])
    cfg = from_args(GatewayConfig, ns)
    assert cfg.api_key == ["a,b", "c"]
    assert SECRET not in repr(GatewayConfig(lms="l:1", api_key=[SECRET]))


def test_a_keys_file_names_one_tenant_per_key_and_a_tenant_may_have_several(tmp_path):
    path = keys_file(tmp_path, "# rotation: acme has two keys", "",
                     {"tenant": "acme", "key": "ka1"}, {"tenant": "acme", "key": "ka2"}, {"tenant": "lab.2", "key": "kl"})
    tenants = Tenants(["kd"], path)
    assert [tenants.identify(f"Bearer {k}").name for k in ("ka1", "ka2", "kl", "kd")] == ["acme", "acme", "lab.2",
                                                                                          DEFAULT]
    assert tenants.names() == ["acme", "default", "lab.2"]


@pytest.mark.parametrize("line,why", [
    ('{"tenant": "a", "key": ', "not a JSON object"),
    ('["a", "k"]', "not a JSON object"),
    ({"tenant": "a", "key": SECRET, "max_inflight": 3}, "unknown field(s) ['max_inflight']"),
    ({"tenant": "a", "key": SECRET, "max_in_flight": 0}, '"max_in_flight" must be an integer of at least 1'),
    ({"tenant": "a", "key": SECRET, "max_in_flight": 2.5}, '"max_in_flight" must be an integer'),
    ({"tenant": "a", "key": SECRET, "max_in_flight": True}, '"max_in_flight" must be an integer'),
    ({"tenant": "a", "key": SECRET, "max_queue": -1}, '"max_queue" must be an integer of at least 0'),
    ({"tenant": "a", "key": SECRET, "max_queue": "2"}, '"max_queue" must be an integer'),
    ({"tenant": "a", "key": SECRET, "body_mib": 0}, '"body_mib" must be a number above 0'),
    ({"tenant": "a", "key": SECRET, "body_mib": "64"}, '"body_mib" must be a number'),
    ({"tenant": "a", "key": SECRET, "weight": 0}, '"weight" must be a number above 0'),
    ({"tenant": "a", "key": SECRET, "weight": True}, '"weight" must be a number above 0'),
    ({"tenant": "a", "key": SECRET, "images_per_minute": None}, '"images_per_minute" must be an integer'),
    ({"tenant": "a", "key": SECRET, "max_background": [1]}, '"max_background" must be an integer'),
    ({"tenant": "a b", "key": SECRET}, '"tenant" must match'),
    ({"tenant": ANONYMOUS, "key": SECRET}, '"tenant" must match'),
    ({"key": SECRET}, '"tenant" must match'),
    ({"tenant": "a", "key": ""}, '"key" must be printable ASCII'),
    ({"tenant": "a", "key": SECRET + " "}, '"key" must be printable ASCII'),
    ({"tenant": "a", "key": SECRET + "\u00e9"}, '"key" must be printable ASCII'),
])
def test_a_bad_line_is_refused_naming_the_line_and_never_the_key(tmp_path, line, why):
    path = keys_file(tmp_path, {"tenant": "ok", "key": "fine"}, line)
    with pytest.raises(ValueError) as e:
        Tenants(keys_file=path)
    assert f"{path}, line 2: " in str(e.value) and why in str(e.value)
    assert SECRET not in str(e.value)


def test_a_tenants_quotas_are_read_from_its_lines_and_unset_ones_mean_no_limit(tmp_path):
    path = keys_file(tmp_path, {"tenant": "a", "key": "ka1", "max_in_flight": 2, "max_queue": 0, "body_mib": 1.5,
                                "images_per_minute": 30, "max_background": 0},
                     {"tenant": "a", "key": "ka2", "max_in_flight": 2, "max_queue": 0, "body_mib": 1.5,
                      "images_per_minute": 30, "max_background": 0},
                     {"tenant": "b", "key": "kb", "body_mib": 64, "weight": 2.5})
    tenants = Tenants(["kd"], path)
    a = Tenant("a", max_in_flight=2, max_queue=0, body_mib=1.5, images_per_minute=30, max_background=0)
    assert tenants.identify("Bearer ka2") == a and tenants.quota("a") == a and a.body_bytes == 3 << 19
    assert tenants.quota("b") == Tenant("b", body_mib=64.0, weight=2.5) and tenants.quota("b").share == 2.5
    assert a.share == 1.0  # no weight: 1
    # A tenant without quotas, --api-key's, and a name the file does not know: no limits.
    for name in (DEFAULT, ANONYMOUS, "nobody"):
        assert tenants.quota(name) == Tenant(name)


def test_each_tenant_has_its_weights_part_of_every_named_tenants_weight(tmp_path):
    path = keys_file(tmp_path, {"tenant": "a", "key": "ka"}, {"tenant": "a", "key": "ka2"},
                     {"tenant": "b", "key": "kb", "weight": 2.5})
    tenants = Tenants(["kd"], path)  # a (1), b (2.5) and --api-key's default (1): 4.5 in all
    parts = {name: tenants.quota(name).part for name in ("a", "b", DEFAULT, "nobody")}
    assert parts == pytest.approx({"a": 1 / 4.5, "b": 2.5 / 4.5, DEFAULT: 1 / 4.5, "nobody": 0.0})
    assert tenants.identify("Bearer ka2").part == pytest.approx(1 / 4.5)
    assert Tenants().quota(ANONYMOUS).part == 1.0  # without keys: the one tenant, all of it
    assert Tenants(["kd"]).quota(DEFAULT).part == 1.0


@pytest.mark.parametrize("second", [
    {"tenant": "a", "key": "k2", "max_in_flight": 3},  # another value
    {"tenant": "a", "key": "k2"},  # the field left out
    {"tenant": "a", "key": "k2", "max_in_flight": 2, "max_queue": 1},  # one more field
])
def test_every_line_of_a_tenant_must_set_the_same_quotas_or_the_file_is_refused_naming_the_line(tmp_path, second):
    path = keys_file(tmp_path, {"tenant": "b", "key": "kb"}, {"tenant": "a", "key": "k1", "max_in_flight": 2}, second)
    with pytest.raises(ValueError) as e:
        Tenants(keys_file=path)
    assert f"{path}, line 3: tenant a's quotas differ from its line 2" in str(e.value)


def test_a_reload_swaps_the_quotas_with_the_keys_and_a_bad_file_keeps_both(tmp_path):
    path = tmp_path / "keys.jsonl"
    path.write_text(json.dumps({"tenant": "a", "key": "k1", "max_in_flight": 2}) + "\n")
    tenants = Tenants(keys_file=str(path))
    assert tenants.quota("a").max_in_flight == 2
    path.write_text(json.dumps({"tenant": "a", "key": "k1", "max_in_flight": 5, "images_per_minute": 10}) + "\n")
    assert tenants.reload()
    assert tenants.quota("a") == Tenant("a", max_in_flight=5, images_per_minute=10)
    path.write_text(json.dumps({"tenant": "a", "key": "k1", "max_in_flight": "many"}) + "\n")
    assert not tenants.reload()
    assert tenants.quota("a") == Tenant("a", max_in_flight=5, images_per_minute=10)


def test_one_key_names_one_tenant(tmp_path):
    with pytest.raises(ValueError, match="line 2: the same key as line 1"):
        Tenants(keys_file=keys_file(tmp_path, {"tenant": "a", "key": SECRET}, {"tenant": "b", "key": SECRET}))
    with pytest.raises(ValueError, match="line 1: the same key as --api-key"):
        Tenants([SECRET], keys_file(tmp_path, {"tenant": "a", "key": SECRET}))


def test_a_keys_file_without_keys_is_refused_so_that_an_emptied_file_never_opens_the_gateway(tmp_path):
    with pytest.raises(ValueError, match="no keys"):
        Tenants(keys_file=keys_file(tmp_path, "# nobody yet"))


def test_the_gateway_command_refuses_a_keys_file_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="--api-keys-file: .*missing.jsonl"):
        load_tenants(GatewayConfig(lms="l:1", api_keys_file=str(tmp_path / "missing.jsonl")))


def test_reload_swaps_the_file_keys_and_keeps_the_flag_keys(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    path = keys_file(tmp_path, {"tenant": "acme", "key": SECRET})
    tenants = Tenants(["flag-key"], path)
    assert tenants.identify(f"Bearer {SECRET}") == Tenant("acme")
    keys_file(tmp_path, {"tenant": "acme", "key": SECRET + "-new"})
    assert tenants.reload()
    assert tenants.identify(f"Bearer {SECRET}") is None
    assert tenants.identify(f"Bearer {SECRET}-new") == Tenant("acme")
    assert tenants.identify("Bearer flag-key") == Tenant(DEFAULT)
    assert "reloaded" in caplog.text and SECRET not in caplog.text and "flag-key" not in caplog.text


@pytest.mark.parametrize("broken", [
    '{"tenant": "acme", "key": "' + SECRET + '-2"',  # cut short while written
    "# emptied",
    None,  # removed
])
def test_a_file_that_does_not_load_leaves_the_keys_as_they_were_and_the_log_says_why(tmp_path, caplog, broken):
    caplog.set_level(logging.DEBUG)
    path = keys_file(tmp_path, {"tenant": "acme", "key": SECRET})
    tenants = Tenants(keys_file=path)
    if broken is None:
        (tmp_path / "keys.jsonl").unlink()
    else:
        keys_file(tmp_path, broken)
    assert not tenants.reload()
    assert tenants.identify(f"Bearer {SECRET}") == Tenant("acme")
    assert "not reloaded" in caplog.text and SECRET not in caplog.text


def test_no_key_shows_in_a_repr_or_a_description(tmp_path):
    tenants = Tenants([SECRET], keys_file(tmp_path, {"tenant": "acme", "key": SECRET + "x"}))
    assert SECRET not in repr(tenants) and SECRET not in tenants.describe()
    assert "2 key(s)" in tenants.describe() and "acme" in tenants.describe()
    assert SECRET not in repr(vars(tenants))  # only digests are kept

