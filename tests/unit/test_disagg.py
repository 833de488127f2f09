"""The pure pieces of disaggregation: page runs and addresses, layout checks, arrival records and
the bootstrap service's room state machine."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.server.disagg.prefill_rooms import PeerRefused, PrefillRoomTable, RoomState
from tandem.server.disagg.layout import (
    KVBuffer, KVLayout, LayoutMismatch, check_split, destination_runs, page_runs, prompt_digest, same_split,
    transfer_plan, write_list,
)
from tandem.server.disagg.transfer import RECORD_BYTES, ArrivalRecord, RecordBuffer

LAYOUT = KVLayout(model="llama:m", kv_dtype="float32", page_size=4, num_layers=2, num_kv_heads=1, head_dim=2, page_bytes=32)


def test_page_runs_coalesce_where_both_sides_are_consecutive():
    assert page_runs([3, 4, 5, 9, 10], [7, 8, 9, 1, 2]) == [(3, 7, 3), (9, 1, 2)]
    assert page_runs([1, 2, 3], [5, 4, 3]) == [(1, 5, 1), (2, 4, 1), (3, 3, 1)]
    assert page_runs([], []) == []
    with pytest.raises(ValueError, match="2 source pages for 1"):
        page_runs([1, 2], [1])


def test_write_list_addresses_every_layer_k_and_v():
    src, dst = KVBuffer(base=1000, num_pages=10, first_head=0, num_heads=1), KVBuffer(50_000, 6, 0, 1)
    srcs, dsts, lens = write_list(LAYOUT, src, dst, [2, 3], [4, 5])
    assert len(srcs) == 4 and lens == [64] * 4  # one run x 2 layers x K,V; two pages each
    # (layer, kv) blocks are num_pages pages apart; page p starts p * page_bytes in.
    assert srcs == [1000 + (b * 10 + 2) * 32 for b in range(4)]
    assert dsts == [50_000 + (b * 6 + 4) * 32 for b in range(4)]


# A 3-KV-head model, its pools as numpy arrays inside one flat "address space" (addresses are
# offsets into MEMORY), split over 1 or 3 tensor-parallel ranks.
HEADS3 = KVLayout(model="llama:m", kv_dtype="float32", page_size=4, num_layers=2, num_kv_heads=3, head_dim=2,
                  page_bytes=4 * 3 * 2 * 4)


def pools(size: int, num_pages: int, base: int, seed: int):
    """`size` ranks' buffers over HEADS3 at `base`...: (parts, arrays [L, 2, pages, P, heads, D])."""
    rng = np.random.default_rng(seed)
    parts, arrays, per = [], [], 3 // size
    for rank in range(size):
        array = rng.standard_normal((2, 2, num_pages, 4, per, 2)).astype(np.float32)
        parts.append(KVBuffer(base + rank * 100_000, num_pages, rank * per, per, f"rank{rank}"))
        arrays.append(array)
    return parts, arrays


def run_writes(plan, src_parts, src_arrays, dst_parts, dst_arrays, dst_pages):
    """Each source rank's writes, packing as MooncakeTransfer.send does (staging at 900,000...),
    then each destination turned token-major as on arrival when the splits differ."""
    memory = np.zeros(1_000_000, dtype=np.uint8)
    for part, array in zip(src_parts + dst_parts, src_arrays + dst_arrays):
        memory[part.base : part.base + array.nbytes] = array.view(np.uint8).ravel()
    sessions = {p.session for p in dst_parts}
    for writes, array in zip(plan, src_arrays):
        for w in writes:
            assert w.session in sessions
            srcs = w.srcs
            if w.packed is not None:  # per destination run: [L, 2, heads, pages, P, D]
                p = w.packed
                staging = np.concatenate([array[:, :, pages, :, p.first : p.last].transpose(0, 1, 4, 2, 3, 5).ravel()
                                          for pages in p.runs])
                memory[900_000 : 900_000 + staging.nbytes] = staging.view(np.uint8)
                srcs = list(900_000 + np.cumsum([0] + w.lens[:-1]))
            for s, d, n in zip(srcs, w.dsts, w.lens):
                memory[d : d + n] = memory[s : s + n]
    after = [memory[p.base : p.base + a.nbytes].view(np.float32).reshape(a.shape).copy() for p, a in zip(dst_parts, dst_arrays)]
    if not same_split(src_parts, dst_parts):  # what token_major does on arrival
        for a in after:
            L, KV, _, P, H, D = a.shape
            for start, n in destination_runs(dst_pages):
                run = a[:, :, start : start + n].copy()
                a[:, :, start : start + n] = run.reshape(L, KV, H, n, P, D).transpose(0, 1, 3, 4, 2, 5)
    return after


@pytest.mark.parametrize("src_size, dst_size", [(3, 1), (1, 3), (3, 3), (1, 1)])
def test_transfer_plan_moves_every_head_between_any_two_splits(src_size, dst_size):
    src_parts, src_arrays = pools(src_size, 6, 0, seed=1)
    dst_parts, dst_arrays = pools(dst_size, 5, 500_000, seed=2)
    src_pages, dst_pages = [1, 2, 5], [3, 4, 0]
    plan = transfer_plan(HEADS3, src_parts, dst_parts, src_pages, dst_pages)
    assert len(plan) == src_size
    after = run_writes(plan, src_parts, src_arrays, dst_parts, dst_arrays, dst_pages)
    whole_src = np.concatenate(src_arrays, axis=4)  # [L, 2, pages, P, 3 heads, D]
    whole_before, whole_after = np.concatenate(dst_arrays, axis=4), np.concatenate(after, axis=4)
    for s, d in zip(src_pages, dst_pages):
        assert np.array_equal(whole_after[:, :, d], whole_src[:, :, s])
    untouched = [p for p in range(5) if p not in dst_pages]
    assert np.array_equal(whole_after[:, :, untouched], whole_before[:, :, untouched])
    # Same split: whole pages in runs where both sides are consecutive; different: one packed
    # chunk per (rank pair, run of destination pages, layer, K|V).
    entries = sum(len(w.dsts) for writes in plan for w in writes)
    if src_size == dst_size:
        assert entries == src_size * 2 * 2 * 2  # ranks x runs (1, 2 -> 3, 4 and 5 -> 0) x layers x K,V
    else:
        assert entries == 3 * 2 * 2 * 2  # rank pairs sharing heads x runs (3, 4 and 0) x layers x K,V


@pytest.mark.parametrize("src_size, dst_size", [(3, 1), (1, 3)])
def test_pack_and_token_major_round_trip_through_the_plan(src_size, dst_size):
    """The torch side of a packed transfer (what each rank runs): `pack` on every source rank,
    the plan's writes as byte copies, then `token_major` on every destination rank."""
    import torch

    from tandem.server.disagg.transfer import pack, token_major

    per_src, per_dst, num_pages = 3 // src_size, 3 // dst_size, 8
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 2, num_pages, 4, per_src, 2, generator=g) for _ in range(src_size)]
    dests = [torch.zeros(2, 2, num_pages, 4, per_dst, 2) for _ in range(dst_size)]
    src_parts = [KVBuffer(0, num_pages, r * per_src, per_src, f"s{r}") for r in range(src_size)]
    dst_parts = [KVBuffer(0, num_pages, r * per_dst, per_dst, f"d{r}") for r in range(dst_size)]
    src_pages, dst_pages = [6, 1, 2, 7], [2, 3, 4, 0]
    for buffer, writes in zip(sources, transfer_plan(HEADS3, src_parts, dst_parts, src_pages, dst_pages)):
        for w in writes:
            staging = pack(buffer, w.packed).view(torch.uint8)
            target = dests[int(w.session[1:])].view(-1).view(torch.uint8)
            offset = 0
            for d, n in zip(w.dsts, w.lens):  # bases are 0: addresses are byte offsets
                target[d : d + n] = staging[offset : offset + n]
                offset += n
    for buffer in dests:
        token_major(buffer, dst_pages)
    whole_src, whole_dst = torch.cat(sources, dim=4), torch.cat(dests, dim=4)
    assert torch.equal(whole_dst[:, :, dst_pages], whole_src[:, :, src_pages])


def test_a_split_that_misses_or_repeats_a_head_is_refused_by_name():
    parts, _ = pools(3, 4, 0, seed=0)
    check_split(HEADS3, parts, "of decode d")
    with pytest.raises(LayoutMismatch, match=r"of decode d is split into head ranges \[\(0, 1\), \(2, 3\)\].*"
                                             "each of the model's 3 KV heads exactly once"):
        check_split(HEADS3, [parts[0], parts[2]], "of decode d")
    with pytest.raises(LayoutMismatch, match=r"over \[4, 4, 7\] pages"):
        check_split(HEADS3, parts[:2] + [KVBuffer(0, 7, 2, 1)], "of decode d")


# A latent pool (MLA): one part per layer, one latent row per token, held whole by every rank.
LATENT = KVLayout(model="deepseek_v3:m", kv_dtype="float32", page_size=4, num_layers=2, num_kv_heads=1, head_dim=6,
                  page_bytes=4 * 6 * 4, kv_parts=1, replicated=True)


@pytest.mark.parametrize("src_size, dst_size", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_a_latent_pool_moves_each_page_once_per_destination_rank_from_one_source(src_size, dst_size):
    """Every rank holds the whole latent: the first source rank writes whole pages, one layer's
    latent per run, to every destination rank; the others send nothing."""
    rng = np.random.default_rng(3)
    src = [rng.standard_normal((2, 1, 6, 4, 1, 6)).astype(np.float32)] * src_size  # the same on every rank
    src_parts = [KVBuffer(r * 100_000, 6, 0, 1, f"s{r}") for r in range(src_size)]
    dst = [np.zeros((2, 1, 5, 4, 1, 6), dtype=np.float32) for _ in range(dst_size)]
    dst_parts = [KVBuffer(500_000 + r * 100_000, 5, 0, 1, f"d{r}") for r in range(dst_size)]
    check_split(LATENT, dst_parts, "of decode d")
    src_pages, dst_pages = [1, 2, 5], [3, 4, 0]
    plan = transfer_plan(LATENT, src_parts, dst_parts, src_pages, dst_pages)
    assert [len(writes) for writes in plan] == [dst_size] + [0] * (src_size - 1)
    moved = sum(sum(w.lens) for writes in plan for w in writes)
    assert moved == dst_size * len(src_pages) * LATENT.page_bytes_all_parts  # one copy per destination rank
    memory = np.zeros(1_000_000, dtype=np.uint8)
    memory[0 : src[0].nbytes] = src[0].view(np.uint8).ravel()
    for w in plan[0]:
        for s, d, n in zip(w.srcs, w.dsts, w.lens):
            memory[d : d + n] = memory[s : s + n]
    for part, array in zip(dst_parts, dst):
        after = memory[part.base : part.base + array.nbytes].view(np.float32).reshape(array.shape)
        assert np.array_equal(after[:, :, dst_pages], src[0][:, :, src_pages])


def test_a_latent_pool_must_be_whole_on_every_rank():
    with pytest.raises(LayoutMismatch, match=r"the latent KV pool of decode d .* every rank must hold it whole"):
        check_split(LATENT, [KVBuffer(0, 4, 0, 1), KVBuffer(0, 4, 1, 1)], "of decode d")


def test_a_latent_and_a_head_pool_are_told_apart_by_field():
    heads = KVLayout(**{**LATENT.to_json(), "kv_parts": 2, "replicated": False})
    with pytest.raises(LayoutMismatch, match=r"kv_parts: 1 here, 2 peer; replicated: True here, False peer"):
        LATENT.check_compatible(heads)
    # a peer from before these fields reads as K and V per head
    assert KVLayout.from_json({k: v for k, v in LAYOUT.to_json().items() if k not in ("kv_parts", "replicated")}) == LAYOUT


def test_layout_mismatch_names_every_field():
    other = KVLayout(**{**LAYOUT.to_json(), "page_size": 8, "kv_dtype": "bfloat16"})
    LAYOUT.check_compatible(KVLayout.from_json(LAYOUT.to_json()))
    with pytest.raises(LayoutMismatch, match=r"kv_dtype: 'float32' here, 'bfloat16' peer; page_size: 4 here, 8 peer"):
        LAYOUT.check_compatible(other)


def test_arrival_record_round_trip_and_torn_reads():
    rec = ArrivalRecord(room=123, first_token=42, cached_tokens=16, logprob=-0.5)
    assert ArrivalRecord.unpack(rec.pack()) == rec
    assert ArrivalRecord.unpack(bytes(RECORD_BYTES)) is None  # empty slot
    torn = bytearray(rec.pack())
    torn[8] ^= 1  # first token half-written
    assert ArrivalRecord.unpack(bytes(torn)) is None
    buf = RecordBuffer(3)
    buf.write(2, rec)
    assert buf.read(2) == rec and buf.read(1) is None
    buf.clear(2)
    assert buf.read(2) is None


def _register(table, room, prompt=(1, 2, 3, 4, 5), pages=(0, 1), instance="d1", skip_pages=None):
    body = {"room": room, "decode": "d", "decode_instance": instance, "request_id": "r", "prompt_len": len(prompt),
            "digest": prompt_digest(list(prompt)), "pages": list(pages), "record_slot": 0}
    if skip_pages is not None:  # a decode older than the field sends none
        body["skip_pages"] = skip_pages
    return table.register(body)


def _add_peer(table, instance="d1"):
    return table.add_peer({"decode": "d", "decode_instance": instance, "session": "127.0.0.1:2", "layout": LAYOUT.to_json(),
                           "kv_parts": [KVBuffer(0, 8, 0, 1, "127.0.0.1:2").to_json()], "record_base": 0})


@pytest.fixture
def table():
    wakes = []
    t = PrefillRoomTable(LAYOUT, "127.0.0.1:1", wake=lambda: wakes.append(1))
    _add_peer(t)
    t.wakes = wakes
    return t


@pytest.mark.parametrize("decode_first", [True, False])
def test_room_pairs_in_either_order(table, decode_first):
    prompt = [1, 2, 3, 4, 5]
    if decode_first:
        assert _register(table, 7).state is RoomState.REGISTERED
        assert table.claim(7, "p", 5, prompt_digest(prompt)).state is RoomState.QUEUED
    else:
        assert table.claim(7, "p", 5, prompt_digest(prompt)).state is RoomState.CLAIMED
        assert _register(table, 7).state is RoomState.QUEUED
    assert table.start_transfer(7).pages == [0, 1]
    assert table.cancel(7, "late") == "transferring"  # a write in flight is not cut off
    table.set_state(7, RoomState.DONE)
    assert table.status([7, 8])["rooms"] == {"7": {"state": "done", "message": "", "code": ""},
                                             "8": {"state": "unknown", "message": "", "code": ""}}
    assert table.wakes  # the loop is nudged on registration


def test_wrong_room_fails_both_legs(table):
    table.claim(7, "p", 5, prompt_digest([9, 9, 9, 9, 9]))
    room = _register(table, 7)
    assert room.state is RoomState.FAILED and "wrong bootstrap_room 7" in room.message and room.code == "failed_precondition"


def test_cancel_before_transfer_blocks_it(table):
    _register(table, 7)
    table.claim(7, "p", 5, prompt_digest([1, 2, 3, 4, 5]))
    assert table.cancel(7, "client went away") == "failed"
    assert table.start_transfer(7) is None
    # A cancel for a room nobody has seen makes a later prefill leg fail at once.
    table.cancel(9, "decode refused")
    assert table.claim(9, "p2", 5, 0).state is RoomState.FAILED


def test_registration_is_validated(table):
    with pytest.raises(ValueError, match="2 destination pages for 9 prompt tokens with skip_pages 0; need 3"):
        _register(table, 7, prompt=range(9))
    with pytest.raises(ValueError, match=r"need 2 in \[0, 8\)"):
        _register(table, 7, pages=(0, 8))
    with pytest.raises(PeerRefused, match="not registered") as refused:
        table.register({"decode": "nobody", "decode_instance": "x", "room": 1})
    assert refused.value.reason == "unknown_peer"
    _register(table, 7)
    with pytest.raises(ValueError, match="already registered"):
        _register(table, 7)


def test_registration_may_leave_out_the_pages_the_decode_holds(table):
    """A decode whose prefix cache holds the prompt's first pages registers destinations for the
    rest; the last page always moves, and the counts must add up."""
    prompt = list(range(9))  # 3 pages of 4
    assert table.claim(7, "p", 9, prompt_digest(prompt)).state is RoomState.CLAIMED
    assert _register(table, 7, prompt=prompt, pages=(5,), skip_pages=2).state is RoomState.QUEUED
    reg = table.start_transfer(7)
    assert (reg.skip_pages, reg.pages) == (2, [5])
    for skip, pages, why in ((3, (), r"skip_pages 3 for 9 prompt tokens: must be in \[0, 3\)"),
                             (-1, (1, 2, 3, 4), r"skip_pages -1 for 9 prompt tokens: must be in \[0, 3\)"),
                             (1, (5,), "1 destination pages for 9 prompt tokens with skip_pages 1; need 2")):
        with pytest.raises(ValueError, match=why):
            _register(table, 8, prompt=prompt, pages=pages, skip_pages=skip)
    assert table.get(8) is None  # a refused registration leaves no room behind


def test_unclaimed_rooms_expire(table):
    room = _register(table, 7)
    table.expire(room.created + 1.0, bootstrap_timeout=5.0)
    assert table.get(7).state is RoomState.REGISTERED
    table.expire(room.created + 6.0, bootstrap_timeout=5.0)
    assert table.get(7).state is RoomState.FAILED and table.get(7).code == "deadline_exceeded"
    table.expire(room.created + 6.0 + 1000, bootstrap_timeout=5.0)
    assert table.get(7) is None  # forgotten long after it finished


def test_each_start_has_its_own_instance():
    assert PrefillRoomTable(LAYOUT, "s").instance != PrefillRoomTable(LAYOUT, "s").instance


def test_a_restarted_decode_replaces_its_predecessor_and_its_rooms_fail(table):
    """Same name (address), new instance: the old instance's unstarted rooms end; a started
    write is left to finish; the old instance can register nothing more."""
    _register(table, 1)  # registered, no prefill leg yet
    _register(table, 2)
    table.claim(2, "p2", 5, prompt_digest([1, 2, 3, 4, 5]))  # queued for the forward pass
    _register(table, 3)
    table.claim(3, "p3", 5, prompt_digest([1, 2, 3, 4, 5]))
    table.start_transfer(3)  # writing
    _add_peer(table, instance="d2")
    for room in (1, 2):
        assert table.get(room).state is RoomState.FAILED and table.get(room).code == "unavailable"
        assert "decode peer d restarted (instance d1 replaced by d2)" in table.get(room).message
    assert table.get(3).state is RoomState.TRANSFERRING
    assert table.counters == {"peer_handshakes": 1, "peer_rehandshakes": 1}
    with pytest.raises(PeerRefused, match="instance d1"):
        _register(table, 4, instance="d1")
    assert _register(table, 4, instance="d2").state is RoomState.REGISTERED


def test_a_leaving_decode_releases_its_rooms(table):
    _register(table, 1)
    assert table.remove_peer("d", "someone-else") == 0  # only the registered instance can leave
    assert table.remove_peer("d", "d1") == 1
    assert table.get(1).state is RoomState.FAILED and "shutting down" in table.get(1).message
    assert table.heartbeat("d", "d1") == {"known": False, "leaving": False}
    with pytest.raises(PeerRefused) as refused:
        _register(table, 2)
    assert refused.value.reason == "unknown_peer"


def test_a_leaving_prefill_serves_claimed_rooms_refuses_new_ones_and_tells_each_peer(table):
    table.claim(5, "p5", 5, prompt_digest([1, 2, 3, 4, 5]))  # a prefill leg in flight
    assert table.heartbeat("d", "d1") == {"known": True, "leaving": False}
    table.leave()
    assert table.unnotified() == ["d"]
    assert _register(table, 5).state is RoomState.QUEUED  # its decode leg still pairs
    with pytest.raises(PeerRefused) as refused:
        _register(table, 6)  # no prefill leg will ever come here
    assert refused.value.reason == "leaving"
    with pytest.raises(PeerRefused):
        _add_peer(table, instance="d9")
    assert table.status([5], "d") == {"rooms": {"5": {"state": "queued", "message": "", "code": ""}}, "leaving": True}
    assert table.unnotified() == []  # the status answer told it
