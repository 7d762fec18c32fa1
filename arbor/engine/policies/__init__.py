"""Scheduling policies of the engine: which sequences run in a step and how the step runs
(prefill-first, mixed, P/D multiplexing, LayerKV), with their admission and P/D coordination."""
