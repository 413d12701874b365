"""The numerics check's figures, a refusal as a reason, and the build report's columns and SNR gate: no lowering."""

from __future__ import annotations

import numpy as np
import torch

from lowercache.lowering.check import numerics, numerics_report


def test_figures_of_an_exact_match_and_of_a_zero_output():
    same = [torch.ones(2, 4)]
    exact = numerics.figures(same, same)
    assert exact["snr_db"] is None and exact["cosine"] == 1.0 and exact["max_abs"] == 0.0 and exact["top1"] == 1.0
    assert numerics_report.snr_text(exact["snr_db"]) == "inf"
    zero = numerics.figures([torch.zeros(3)], [torch.ones(3)])
    assert zero["snr_db"] == -999.0 and "top1" not in zero and zero["cosine"] == 0.0


def test_a_refusal_is_a_reason_not_an_exception():
    empty = numerics.reference_run(b"\0" * 64, [])
    assert isinstance(empty, str) and empty
    said = numerics.reference_run(b"\0" * 64, [np.zeros((1, 3), np.int8)])
    assert isinstance(said, str) and said


def test_build_report_has_the_figures_and_compare_flags_an_snr_drop_beyond_the_build_file_threshold():
    from lowercache.zoo import report

    def row(snr, model="kws", error=None):
        checked = {"samples": 4, "snr_db": snr, "cosine": 0.99, "max_abs": 0.1, "top1": 0.75}
        if error:
            checked = {"samples": 4, "error": error}
        return {"model": model, "target": "ethos-u55-128", "outcome": "miss", "seconds": 1.0, "pte": {"size": 1, "xxh3_128": "x"}, "estimate": None,
                "numerics": checked}

    before = {"pairs": [row(38.0), row(30.0, "vww"), row(20.0, "kwt")]}
    after = [row(33.5), row(29.0, "vww"), row(None, "kwt", error="not compared: partition 0: crashed")]
    assert report.compare(before, after) == [
        "kws on ethos-u55-128: SNR 38.0 dB -> 33.5 dB (-4.5 dB)",
        "vww on ethos-u55-128: SNR 30.0 dB -> 29.0 dB (-1.0 dB)",
        "kwt on ethos-u55-128: SNR 20.0 dB -> not compared",
    ]
    assert report.regressions(before, after, 3.0) == [
        "kws on ethos-u55-128: SNR fell 4.5 dB (38.0 dB -> 33.5 dB), more than max-snr-drop 3 dB",
        "kwt on ethos-u55-128: SNR fell from a measure to none (20.0 dB -> not compared), more than max-snr-drop 3 dB",
    ]
    assert report.regressions(before, after[:2], 5.0) == []
    text = report.markdown({"pairs": after, "regressions": ["kws ..."]})
    assert "| SNR | cosine | top-1 |" in text and "| 33.5 dB | 0.990000 | 75.0% |" in text and "not compared" in text
    assert "### Numerics regressions" in text
