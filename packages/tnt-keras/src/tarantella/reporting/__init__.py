"""What tarantella tells the user, and where: errors raised at the user's call with
Keras' traceback filtering, warnings attributed to the user's line, the package's
logger."""
