"""How many decode rows this CPU's greedy screen takes in one call: tests that check the screen or a greedy burst
ran size their batches to it."""

from __future__ import annotations


def greedy_screen_rows(most: int = 32) -> int:
    """The most decode rows, up to `most`, that this CPU's greedy screen (backends/cpu/greedy_screen.py), and so a
    greedy burst, takes in one call: any batch with the int8 screen or AVX-512's bf16 screen, nine with AVX2's bf16
    screen (two where its tiles are switched off). `most` where there is no native library."""
    from flashllm.backends.cpu import native
    from flashllm.backends.cpu.greedy_screen import int8_screen_runs

    lib = native.library()
    if lib is None or int8_screen_runs():
        return most
    return next((rows for rows in range(most, 1, -1) if lib.flashllm_bf16_screen_takes(rows)), 1)
