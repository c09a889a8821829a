"""What every command line entry point sets up the same way: the log format, and the libraries
whose INFO lines would bury the command's own output."""

import logging

NOISY = ("absl", "orbax", "jax._src", "httpx", "transformers")


def setup_logging(*, timestamps: bool = True) -> None:
  fmt = "%(levelname)s %(name)s: %(message)s"
  logging.basicConfig(level=logging.INFO, format="%(asctime)s " + fmt if timestamps else fmt,
                      datefmt="%H:%M:%S")
  for name in NOISY:
    logging.getLogger(name).setLevel(logging.WARNING)
