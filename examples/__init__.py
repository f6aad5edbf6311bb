"""Runnable examples and a small model zoo (GPT, Llama, MLP); see :mod:`autopar.examples.zoo`."""
