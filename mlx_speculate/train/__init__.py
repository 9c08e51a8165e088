"""Training draft heads on the Mac, from the target's own answers.

`python -m mlx_speculate.train {eagle1,eagle3,medusa,dflash}` (`__main__.py`, its flags the
fields of `settings.py` through `options.py`) runs `recipe.train_head`: data (`data.py`),
features (`features.py`), training (`loop.py` with the losses of `objectives.py`), each cached,
resumable and keyed by what it was built from (`keys.py`); `payoff.py` says whether the head
will pay.
"""
