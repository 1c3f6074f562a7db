"""Quality: fidelity to full prefill, exactness, legibility (`python -m benchmarks.quality.<module>`).

- calibration_queries: which calibration queries predict the recall real queries get from an IVF index
- conversation_fidelity: KL and top-1 of linked chunks inside conversations against a full prefill, per layout
- fidelity: fidelity to full prefill per compile prefix (template, prefix-free, dummy)
- hybrid: hybrid representation per chunk vs pure qvpic: tokens per request, evidence legibility
- legibility: Tesseract OCR accuracy vs vision tokens per font size and DPI
- real_shapes: exactness at the real models' shapes, every case of tests/pipeline/runtime/test_real_shapes.py
- recompute: selective recompute across linked chunks, fidelity gained against TTFT
"""
