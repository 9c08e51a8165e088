"""How many tokens to draft: step costs (their file and keys), measuring them, and the
fixed or adaptive policy that weighs them."""
