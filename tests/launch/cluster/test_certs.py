import stat

import pytest
from cryptography import x509

from goodspeed.launch.cluster.certs import CertError, init_certs


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
