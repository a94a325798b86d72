"""TLS and mutual TLS through a real server: certificates from `goodspeed certs init`, identities
from client certificates, and plaintext refused where other machines can reach the verifier."""

import grpc
import pytest

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.session import DrafterError
from goodspeed.drafter.credentials import ClientTLS, open_channel
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.certs import init_certs
from goodspeed.launch.cli import main
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from goodspeed.verifier.server import ServerConfig
from grpckit import ServerThread
from modelkit import greedy_reference, perturbed, tiny_llama


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, 0.05, 1)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ours = init_certs(tmp_path_factory.mktemp("ours"), names=("alice", "bob"))
    theirs = init_certs(tmp_path_factory.mktemp("theirs"), names=("mallory",))
    return ours, theirs


def tls_for(issued, name):
    return ClientTLS(str(issued["ca"].cert), str(issued[name].cert), str(issued[name].key))


@pytest.fixture
def mutual(models, certs):
    ours, _ = certs
    engine = VerificationEngine(models[0], EngineConfig(budget=8, max_draft_len=4))
    with ServerThread(engine, tls_cert=str(ours["server"].cert), tls_key=str(ours["server"].key), tls_client_ca=str(ours["ca"].cert)) as server:
        yield server


def test_a_drafter_over_mutual_tls_generates_the_targets_output(mutual, models, certs):
    target, draft = models
    client = DrafterClient(DrafterConfig(mutual.address, "a", max_new_tokens=10, tls=tls_for(certs[0], "alice")), DraftRunner(draft))
    client.wait_until_serving()
    client.join()
    assert client.generate("0", [1, 2, 3]).token_ids == greedy_reference(target, [1, 2, 3], 10)
    client.close()
    assert [e["tls"] for e in mutual.events("serving")] == ["mutual"]


def test_the_client_certificate_is_the_identity(mutual, certs):
    ours, _ = certs
    alice = pb_grpc.VerifierStub(open_channel(mutual.address, tls_for(ours, "alice")))
    bob = pb_grpc.VerifierStub(open_channel(mutual.address, tls_for(ours, "bob")))
    sid = alice.Join(pb.JoinRequest(drafter_name="a", protocol_version=1)).session_id
    with pytest.raises(grpc.RpcError) as err:
        bob.Leave(pb.LeaveRequest(session_id=sid))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    alice.Leave(pb.LeaveRequest(session_id=sid))


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "another CA's client", "another CA's server trust"])
def test_who_cannot_connect(mutual, certs, who):
    ours, theirs = certs
    tls = {
        "plaintext": None,
        "no client certificate": ClientTLS(str(ours["ca"].cert)),
        "another CA's client": ClientTLS(str(ours["ca"].cert), str(theirs["mallory"].cert), str(theirs["mallory"].key)),
        "another CA's server trust": tls_for(theirs, "mallory"),
    }[who]
    client = DrafterClient(DrafterConfig(mutual.address, "x", connect_timeout_s=1.0, tls=tls), DraftRunner(tiny_llama(0)))
    with pytest.raises(DrafterError):
        client.join()
    client.close()


def test_plaintext_on_a_reachable_address_is_refused(tmp_path, certs, capsys):
    with pytest.raises(ValueError, match="--insecure"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", insecure=True).insecure
    ours, _ = certs
    assert ServerConfig(host="0.0.0.0", tls_cert=str(ours["server"].cert), tls_key=str(ours["server"].key)).tls_cert
    with pytest.raises(ValueError, match="tls-key"):
        ServerConfig(tls_cert=str(ours["server"].cert))
    # The daemon refuses before loading any model (the target named here does not even exist).
    assert main(["verifier", "--target", str(tmp_path / "none"), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--insecure" in capsys.readouterr().err


def test_certs_init_cli(tmp_path, capsys):
    assert main(["certs", "init", str(tmp_path / "c"), "--names", "edge-1,edge-2", "--hosts", "localhost,10.1.2.3"]) == 0
    assert (tmp_path / "c" / "edge-2.key").exists() and "ca.pem" in capsys.readouterr().out


def test_renewed_certificates_are_served_without_a_restart(models, tmp_path, certs):
    """Replace the server's certificate, key and client CA on disk: new connections get the new
    set (an old-CA client is refused, a new-CA client accepted); a broken file keeps the old set."""
    import shutil

    first = init_certs(tmp_path / "first", names=("alice",))
    second = init_certs(tmp_path / "second", names=("alice",))
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(tmp_path / "first" / name, live / name)
    engine = VerificationEngine(models[0], EngineConfig(budget=4))

    def joins(issued):
        channel = open_channel(server.address, tls_for(issued, "alice"))
        try:
            return bool(pb_grpc.VerifierStub(channel).Join(pb.JoinRequest(drafter_name="a", protocol_version=1), timeout=5).session_id)
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    with ServerThread(engine, tls_cert=str(live / "server.pem"), tls_key=str(live / "server.key"), tls_client_ca=str(live / "ca.pem")) as server:
        assert joins(first) and not joins(second)
        (live / "server.pem").write_text("-----BEGIN CERTIFICATE-----\ntruncat")  # a half-written renewal
        assert joins(first)
        assert any("kept the previous" in e["result"] for e in server.events("tls_certificates"))
        for name in ("server.key", "ca.pem", "server.pem"):
            shutil.copy(tmp_path / "second" / name, live / name)
        assert joins(second) and not joins(first)
        assert server.events("tls_certificates")[-1]["result"] == "reloaded"


def test_the_https_front_serves_a_renewed_certificate_without_a_restart(tmp_path, monkeypatch):
    """The HTTPS front (``--http-port`` with a certificate) follows its files as gRPC does: renewed
    under the same CA (``renew_certs``), the next handshake gets the new certificate; a
    half-written renewal keeps the last good pair, and that is logged."""
    import ssl
    import time

    from cryptography import x509

    from goodspeed.launch.cluster.certs import renew_certs
    from goodspeed.verifier import daemon
    from goodspeed.verifier.local import LocalConfig, LocalServing
    from modelkit import chat_pair

    monkeypatch.setattr(daemon, "RELOAD_CHECK_S", 0.05)
    issued = init_certs(tmp_path / "certs", names=("alice",))
    target, draft, tokenizer = chat_pair()
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=4))
    local = LocalServing(engine, draft, LocalConfig(policy="chain", k=2, budget=8))

    def served_serial(port: int) -> int:
        pem = ssl.get_server_certificate(("127.0.0.1", port), ca_certs=str(issued["ca"].cert))
        return x509.load_pem_x509_certificate(pem.encode()).serial_number

    def eventually(predicate) -> bool:
        for _ in range(400):
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    def on_disk() -> int:
        return x509.load_pem_x509_certificate(issued["server"].cert.read_bytes()).serial_number

    with ServerThread(engine, local=local, tokenizer=tokenizer, http_port=0, target_name="tiny",
                      tls_cert=str(issued["server"].cert), tls_key=str(issued["server"].key)) as server:
        port = server.server.http_port
        first = served_serial(port)
        assert first == on_disk()
        renew_certs(tmp_path / "certs")
        assert on_disk() != first
        assert eventually(lambda: served_serial(port) == on_disk())
        assert server.events("https_certificates")[-1]["result"] == "reloaded"
        good = on_disk()
        issued["server"].cert.write_text("-----BEGIN CERTIFICATE-----\ntruncat")  # a half-written renewal
        assert eventually(lambda: any("kept the previous" in e["result"] for e in server.events("https_certificates")))
        assert served_serial(port) == good  # still served, with the last good pair
