import stat

import pytest
from cryptography import x509

from goodspeed.launch.cluster.certs import CertError, init_certs, renew_certs


def test_certs_init_writes_a_ca_a_server_and_named_clients(tmp_path):
    issued = init_certs(tmp_path, names=("edge-1", "edge-2"), hosts=("verifier.lan", "10.0.0.5"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ca.pem", "ca.key", "server.pem", "server.key", "edge-1.pem", "edge-1.key", "edge-2.pem", "edge-2.key"])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in tmp_path.glob("*.key"))
    server = x509.load_pem_x509_certificate(issued["server"].cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["verifier.lan"] and [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    client = x509.load_pem_x509_certificate(issued["edge-1"].cert.read_bytes())
    assert client.subject.rfc4514_string() == "CN=edge-1" and client.issuer.rfc4514_string() == "CN=goodspeed CA"
    with pytest.raises(CertError, match="exists"):  # nothing is overwritten
        init_certs(tmp_path, names=("edge-1",))


@pytest.mark.parametrize("names", [(), ("a", "a"), ("server",), ("ca",), ("a b",), ("x" * 65,)])
def test_bad_names_are_refused(tmp_path, names):
    with pytest.raises(CertError):
        init_certs(tmp_path / "certs", names=names)
    assert not (tmp_path / "certs").exists()  # nothing half-written


def test_a_certificate_valid_for_no_day_is_refused(tmp_path):
    with pytest.raises(CertError, match="at least 1 day"):
        init_certs(tmp_path / "certs", days=0)
    assert not (tmp_path / "certs").exists()


def test_renewed_certificates_are_new_keys_with_the_same_names_under_the_same_ca(tmp_path):
    """Every certificate but the CA's is reissued: a new key and serial, the same subject and
    extensions (the server's hosts), signed by the unchanged CA; keys stay 0600 and no staging
    file is left."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    init_certs(tmp_path, names=("edge-1",), hosts=("verifier.lan", "10.0.0.5"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    renewed = renew_certs(tmp_path)
    assert sorted(renewed) == ["edge-1", "server"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # nothing else written
    assert (tmp_path / "ca.pem").read_bytes() == before["ca.pem"] and (tmp_path / "ca.key").read_bytes() == before["ca.key"]
    ca = x509.load_pem_x509_certificate(before["ca.pem"])
    for stem in ("server", "edge-1"):
        old = x509.load_pem_x509_certificate(before[f"{stem}.pem"])
        new = x509.load_pem_x509_certificate(renewed[stem].cert.read_bytes())
        assert new.serial_number != old.serial_number and new.subject == old.subject
        assert list(new.extensions) == list(old.extensions)
        new.verify_directly_issued_by(ca)
        key = serialization.load_pem_private_key(renewed[stem].key.read_bytes(), password=None)
        assert renewed[stem].key.read_bytes() != before[f"{stem}.key"]
        assert key.public_key().public_numbers() == new.public_key().public_numbers() and isinstance(key, ec.EllipticCurvePrivateKey)
        assert stat.S_IMODE(renewed[stem].key.stat().st_mode) == 0o600
