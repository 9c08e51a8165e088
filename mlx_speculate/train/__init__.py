"""Training draft heads on the Mac, from the target's own answers: rollouts (`rollout.py`) and
Medusa head fitting (`medusa.py`)."""
