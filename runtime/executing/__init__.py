"""Playing one rank's actions: the stage executor, messages, split backward, optimizer, evaluation."""
