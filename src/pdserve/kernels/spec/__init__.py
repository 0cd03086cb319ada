"""Speculative decoding's model side: proposers that draft candidates (prompt
lookup, a draft model in the target's pages) and the verification that
accepts or rejects them against the target's distribution, every draw keyed
by (seed, position). The engine's side (which rounds carry drafts, P's
drafts for D's first verify) is engine/spec/."""
