"""The 3D-HybridEngine: one actor trained in a p-t-d layout and generating in a p_g-t_g-d_g-d
layout on the same ranks (HybridFlow §5). `layouts` describes both layouts as data."""
