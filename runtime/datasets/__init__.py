"""Minibatches by step: synthetic, from a user's function, from image folders and text files."""
