"""Site driver (site_agent.secure_site) against the coordinator adapter (coordinator.secure_round).

Four site threads with TLS-bound identities run a secure round through stage calls served by a
``SecureRound`` under a lock; one site is killed after uploading. A coordinator that swaps an
identity binding for one not issued by the run's CA is refused. Every stage call goes through
the wire translation both ways (``geoloco.protos.secagg_wire``), as it does over gRPC.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from geoloco.algorithms.privacy.private_aggregation import PrivacyConfig, PrivateUpdateEncoder
from geoloco.algorithms.privacy.secagg_messages import STAGE_ADVERTISE_KEYS, SecAggViolation
from geoloco.algorithms.privacy.secagg_stages import Advertisements, StageMessage
from geoloco.coordinator.secure_round import SecureRound
from geoloco.protos import secagg_wire
from geoloco.scenarios.certs import init_ca, issue_site
from geoloco.site_agent.secure_site import SecureSite, SiteIdentity, verify_bindings

NAMES = ["s0", "s1", "s2", "s3"]
NUMEL = 2000


class _Coordinator:
    """Serves stage calls like the servicer would: submit, then wait until the stage is ready."""

    def __init__(self, secure: SecureRound) -> None:
        self.secure = secure
        self.live = set(NAMES)
        self.now = 0.0
        self.cond = threading.Condition()
        self.tamper = None

    def call(self, site: str):  # type: ignore[no-untyped-def]
        def stage_call(stage: str, message: StageMessage) -> tuple[StageMessage, str]:
            request = secagg_wire.stage_request(stage, message, site=site, session_id="", round_number=0, wait_ms=0)
            with self.cond:
                self.secure.submit(site, stage, secagg_wire.request_message(request))
                self.secure.advance(self.live, self.now)
                self.cond.notify_all()
                ok = self.cond.wait_for(lambda: self.secure.reply(site, stage).ready, timeout=30)
                assert ok, f"{site}: stage {stage} never closed"
                reply = self.secure.reply(site, stage)
                if self.tamper is not None and stage == STAGE_ADVERTISE_KEYS and not reply.aborted:
                    reply = dataclasses.replace(reply, message=self.tamper(reply.message))
                response = secagg_wire.stage_response(stage, reply)
                if response.aborted:
                    return None, response.abort_reason
                return secagg_wire.reply_message(stage, response), ""

        return stage_call

    def upload(self, site: str, data: bytes) -> None:
        with self.cond:
            self.secure.receive_upload(site, data)
            self.cond.notify_all()

    def kill(self, site: str) -> None:
        with self.cond:
            self.live.discard(site)
            self.secure.advance(self.live, self.now)
            self.cond.notify_all()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_ca(directory)
    for name in NAMES:
        issue_site(directory, name)
    return directory


def _identity(certs: Path, name: str) -> SiteIdentity:
    return SiteIdentity.create(name, (certs / f"{name}.crt").read_bytes(), (certs / f"{name}.key").read_bytes())


def _site(certs: Path, name: str, privacy: PrivacyConfig, coordinator: _Coordinator) -> SecureSite:
    return SecureSite(
        _identity(certs, name), privacy, "none", numel=NUMEL, session="sess", round_number=0,
        index_seed=5, call=coordinator.call(name), ca_pem=(certs / "ca.crt").read_bytes(),
    )


def test_four_sites_one_killed_after_upload(certs: Path) -> None:
    privacy = PrivacyConfig(secure_aggregation=True, dp="distributed", clip_norm=1.0,
                            noise_multiplier=0.01, chunk_size=512)
    secure = SecureRound(privacy, "none", numel=NUMEL, session="sess", round_number=0,
                         index_seed=5, stage_timeout_s=60, now=0.0)
    coordinator = _Coordinator(secure)
    gen = torch.Generator().manual_seed(1)
    updates = {n: 0.01 * torch.randn(NUMEL, generator=gen) for n in NAMES}
    uploaded = threading.Barrier(len(NAMES))
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            site = _site(certs, name, privacy, coordinator)
            site.share_keys()
            coordinator.upload(name, site.masked_upload(updates[name], PrivateUpdateEncoder(privacy, "none")))
            uploaded.wait(timeout=30)
            if name == "s3":
                coordinator.kill(name)  # gone after uploading: answers nothing more
                return
            if name == "s0":
                with coordinator.cond:
                    coordinator.secure.close_upload(coordinator.now)
                    coordinator.cond.notify_all()
            site.unmask()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(n,)) for n in NAMES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    with coordinator.cond:
        coordinator.secure.advance(coordinator.live, coordinator.now)
    assert secure.done and secure.survivors == NAMES
    mean = secure.result()
    plain = sum(updates.values()) / len(NAMES)
    # Distributed noise of std 0.01 * clip on the sum (scaled by sqrt(n/t)), / n on the mean.
    assert (mean - plain).std().item() == pytest.approx(0.01 * (4 / 3) ** 0.5 / 4, rel=0.1)
    assert 0 < secure.noise_multiplier() <= 0.01


def test_identity_not_issued_by_the_run_ca_is_refused(certs: Path, tmp_path: Path) -> None:
    # The coordinator swaps s1's binding for one from a certificate of another CA.
    init_ca(tmp_path)
    issue_site(tmp_path, "s1")
    forged = _identity(tmp_path, "s1").binding
    ca = (certs / "ca.crt").read_bytes()
    genuine = [_identity(certs, n).binding for n in NAMES]
    assert set(verify_bindings(genuine, ca)) == set(NAMES)
    with pytest.raises(SecAggViolation, match="not bound to a certificate of this run's CA"):
        verify_bindings([genuine[0], forged], ca)
    # An unsigned binding (what --insecure sites send) is refused when TLS is in use.
    unsigned = SiteIdentity.create("s2").binding
    with pytest.raises(SecAggViolation, match="not signed with its TLS key"):
        verify_bindings([unsigned], ca)
    assert set(verify_bindings([unsigned], None)) == {"s2"}


def test_site_refuses_a_round_with_a_substituted_identity(certs: Path, tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_site(tmp_path, "s1")
    forged = _identity(tmp_path, "s1").binding
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    secure = SecureRound(privacy, "none", numel=NUMEL, session="sess", round_number=0,
                         index_seed=5, stage_timeout_s=60, now=0.0)
    coordinator = _Coordinator(secure)

    def swap(reply: Advertisements) -> Advertisements:
        kept = [b for b in reply.bindings if b.name != "s1"]
        return dataclasses.replace(reply, bindings=(*kept, forged))

    coordinator.tamper = swap
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            _site(certs, name, privacy, coordinator).share_keys()
        except BaseException as err:
            errors[name] = err
        finally:
            coordinator.kill(name)

    threads = [threading.Thread(target=run, args=(n,)) for n in NAMES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(errors) == set(NAMES)
    assert all(isinstance(e, SecAggViolation) and "this run's CA" in str(e) for e in errors.values())


def test_site_agent_uplink_refuses_substitution_logs_why_and_sits_the_round_out(
    certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``SecureUplink`` (what ``SiteAgent`` calls) turns a detected substitution into a logged
    refusal: no masked update leaves the site, and the reason is kept."""
    from geoloco.protos.transport_tls import TLSFiles
    from geoloco.site_agent.secure_site import SecureUplink

    init_ca(tmp_path)
    issue_site(tmp_path, "s2")
    forged = _identity(tmp_path, "s2").binding
    privacy = PrivacyConfig(secure_aggregation=True, clip_norm=1.0)
    secure = SecureRound(privacy, "none", numel=NUMEL, session="sess", round_number=0,
                         index_seed=5, stage_timeout_s=60, now=0.0)
    coordinator = _Coordinator(secure)

    def swap(reply: Advertisements) -> Advertisements:
        kept = [b for b in reply.bindings if b.name != "s2"]
        return dataclasses.replace(reply, bindings=(*kept, forged))

    coordinator.tamper = swap

    class _Client:
        def __init__(self, name: str) -> None:
            self.call = coordinator.call(name)

        def secure_stage(self, round_number: int, stage: str, message: StageMessage) -> tuple[StageMessage, str]:
            assert round_number == 0
            return self.call(stage, message)

        def upload(self, **kwargs: object) -> None:
            raise AssertionError("a refused round must not upload")

    uplinks = {n: SecureUplink(n, privacy, "none", tls=TLSFiles.from_dir(certs, n)) for n in NAMES}
    for name, uplink in uplinks.items():
        uplink.begin_round(_Client(name), session="sess", round_number=0, round_seed=1, numel=NUMEL)
    update = torch.full((NUMEL,), 1e-3)
    with caplog.at_level("ERROR", logger="geoloco.site_agent.secure_site"):
        masked = {n: u.masked_update(update) for n, u in uplinks.items()}
    assert masked == dict.fromkeys(NAMES)
    assert all("this run's CA" in u.refusals[0] for u in uplinks.values())
    assert sum("refusing secure round" in r.getMessage() for r in caplog.records) == len(NAMES)
