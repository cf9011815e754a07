"""seqpack."""
