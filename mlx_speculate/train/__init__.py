"""Training draft heads on the Mac, from the target's own answers.

`python -m mlx_speculate.train {eagle1,eagle3,medusa}` (`__main__.py`) runs `recipe.train_head`:
data (`data.py`), features (`features.py`), training (`loop.py` with the losses of
`objectives.py`), each cached and resumable.
"""
