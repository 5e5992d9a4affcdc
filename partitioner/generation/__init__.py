"""Code generation: a traced graph cut by a plan into stage graphs, written as the gpus=N package."""
