"""Published perplexity ratios to compare with (docs/theory.md#m7).

From "Why Do Accumulated Transformations Extrapolate?" (arXiv:2606.24975), as reported in its abstract and public
summaries: ``(model, L, L_train, r(L) = PPL(L) / PPL(L_train))``. Which random variant the 1.60× at 8K refers to
is not stated.
"""

PUBLISHED = [
    ("rope", 8192, 512, 16.2),
    ("random accumulated (Q/K or Q/K/V, not stated)", 8192, 512, 1.60),
    ("rot_random_qkv", 65536, 512, 1.59),
    ("rot_random_qk", 65536, 512, 7.49),
    ("alibi", 65536, 512, 0.96),
]
