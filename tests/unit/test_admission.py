"""The pure admission pieces: per-key token buckets, API-key checks, the scheduler's pool limit."""

from __future__ import annotations

from hetmesh.config import ApiKey, AuthConfig, hash_key
from hetmesh.gateway.auth import Authenticator, TokenBucket
from hetmesh.placement import WorkerView, pool_full
from hetmesh.protocol import Role


def test_bucket_refills_continuously_and_allows_debt() -> None:
    b = TokenBucket(60.0)  # one per second
    assert b.wait_s(60, 0.0) == 0.0
    b.take(60, 0.0)
    assert b.wait_s(1, 0.0) == 1.0
    assert b.wait_s(1, 0.5) == 0.5
    b.take(30, 1.0)  # 1 in the bucket, 30 taken: 29 in debt
    assert b.wait_s(1, 1.0) == 30.0
    assert b.wait_s(1000, 1000.0) == 0.0  # more than a minute's worth waits only for a full bucket


def test_authenticator_keys_and_limits() -> None:
    auth = Authenticator(AuthConfig(keys=[ApiKey(name="a", sha256=hash_key("sk-a"), rpm=2)], default_tpm=100))
    assert auth.authenticate(None).error is not None
    assert auth.authenticate("Bearer sk-b").error.code == "invalid_api_key"  # type: ignore[union-attr]
    v = auth.authenticate("Bearer sk-a")
    assert v.key is not None and v.key.key.name == "a"
    assert auth.admit(auth.authenticate("Bearer sk-a"), 10, 0.0).error is None
    assert auth.admit(auth.authenticate("Bearer sk-a"), 10, 0.0).error is None
    third = auth.admit(auth.authenticate("Bearer sk-a"), 10, 0.0)
    assert third.error is not None and third.error.status == 429 and third.error.retry_after_s == 30.0
    assert Authenticator(AuthConfig()).authenticate(None).error is None  # no keys: open


def test_tokens_charged_after_the_fact() -> None:
    auth = Authenticator(AuthConfig(keys=[ApiKey(name="t", sha256=hash_key("k"), tpm=60)]))
    v = auth.admit(auth.authenticate("Bearer k"), 10, 0.0)
    assert v.error is None
    auth.charge_completion(v, 100, 0.0)  # 50 left, 100 more: 50 in debt
    late = auth.admit(auth.authenticate("Bearer k"), 10, 0.0)
    assert late.error is not None and late.error.type == "tokens" and late.error.retry_after_s == 60.0


def view(wid: str, model: str, load: int, max_batch: int = 8) -> WorkerView:
    return WorkerView(worker_id=wid, model=model, accelerator="nvidia-h100", vendor="nvidia", devices=1,
                      role=Role.BOTH, queue_depth=load, running=0, max_batch=max_batch, kv_blocks_total=10,
                      kv_blocks_used=0, block_size=16)


def test_pool_full_counts_only_the_models_workers() -> None:
    workers = [view("a", "m", 20), view("b", "m", 19), view("c", "other", 1000)]
    assert not pool_full("m", workers, queue_factor=1.5)  # 39 < 2 * 8 * 2.5 = 40
    assert pool_full("m", [*workers[:1], view("b", "m", 20)], queue_factor=1.5)
    assert not pool_full("nobody", workers, queue_factor=1.5)


def test_a_refusal_says_what_exceeded_with_the_digits_that_tell_it_from_the_margin() -> None:
    from hetmesh.placement.admission import refusal

    just_over = refusal(2.0008, 0.01, 1.0004, 1.0, 2.0, 0.1).reason
    assert "1.0004x its 2 s SLO > margin 1" in just_over and "TTFT 2.001 s" in just_over
    assert "TPOT 130 ms is 1.3x its 100 ms SLO" in refusal(0.5, 0.13, 1.3, 1.0, 2.0, 0.1).reason
    retried = refusal(1.0, 0.01, 2.0, 1.0, 2.0, 0.1, waited_s=3.0).reason
    assert "TTFT 4 s (3 s waited already) is 2x its 2 s SLO" in retried
    idle = refusal(30.0, 0.01, 15.0, 1.0, 2.0, 15.0, quiet=3).reason
    assert "idle worker" in idle and "> margin" not in idle
