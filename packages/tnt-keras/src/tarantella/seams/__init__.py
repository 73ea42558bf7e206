"""Where tarantella attaches to Keras objects without changing Keras: the class swap and
attributes set only while a step is traced."""
