"""Batch jobs: the OpenAI Batch format (protocol), the input side (intake), the resumable results file
(results) and requests on one engine (executor). The command line is `nanovllm.run_batch`."""
