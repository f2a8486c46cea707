"""Solutions to grade: a correct one, broken ones (one mistake each) and misbehaving ones."""
