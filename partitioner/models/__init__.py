"""Model specs -> a ModelBundle: the zoo, torchvision:, hf: and file.py specs, their example inputs."""
