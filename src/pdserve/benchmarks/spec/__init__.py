"""`pdserve bench spec`: speculative decoding against plain decoding on an
input-grounded workload. ngram.py is the command (n-gram lookup per k, and
P/D against fused); draft.py its `--draft` cases (the draft-model proposer);
workload.py what both drive (the prompts, a case's engine, the closed loop
that measures it); gate_log.py the speculation gate's rounds printed beside
each table."""
