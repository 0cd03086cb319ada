"""Spec §1: chunk cutting, alignment and reserves, one rule a test."""

from pdserve.scheduler.chunking import admission_headroom, prefill_chunk_tokens, prefill_reserve


def test_a_chunk_that_fits_the_budget_takes_the_whole_rest():
    assert prefill_chunk_tokens(0, 100, 256, 16) == 100


def test_an_incomplete_chunk_ends_on_a_page_boundary():
    assert prefill_chunk_tokens(0, 1000, 100, 16) == 96
    assert prefill_chunk_tokens(8, 1000, 100, 16) == 88     # 8 + 88 = 96


def test_the_completing_chunk_is_exempt_from_alignment():
    # 37 tokens left, budget 40: the chunk finishes the prompt mid-page
    assert prefill_chunk_tokens(960, 997, 40, 16) == 37


def test_a_budget_that_cannot_reach_the_next_boundary_schedules_nothing():
    assert prefill_chunk_tokens(8, 1000, 7, 16) == 0
    assert prefill_chunk_tokens(0, 1000, 0, 16) == 0


def test_intermediate_chunks_reserve_nothing():
    assert prefill_reserve(decodes_locally=False, first_chunk=False, completes=False,
                           rest_of_prompt=500, headroom=100, decode_width=1) == 0


def test_the_completing_chunk_reserves_the_decode_slot_on_every_role():
    for local in (True, False):
        assert prefill_reserve(decodes_locally=local, first_chunk=False, completes=True,
                               rest_of_prompt=0, headroom=0, decode_width=1) == 1


def test_a_decoding_roles_first_chunk_reserves_rest_of_prompt_plus_headroom():
    assert prefill_reserve(decodes_locally=True, first_chunk=True, completes=False,
                           rest_of_prompt=500, headroom=100, decode_width=1) == 600


def test_a_prefill_roles_first_chunk_reserves_no_headroom():
    assert prefill_reserve(decodes_locally=False, first_chunk=True, completes=False,
                           rest_of_prompt=500, headroom=100, decode_width=1) == 0


def test_headroom_is_one_window_per_retraction_plus_one_capped_by_remaining():
    assert admission_headroom(10_000, 4096, 0) == 4096
    assert admission_headroom(10_000, 4096, 1) == 8192
    assert admission_headroom(10_000, 4096, 2) == 10_000
    assert admission_headroom(300, 4096, 0) == 300
