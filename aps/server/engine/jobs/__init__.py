"""The jobs of the update lane: ``updates`` (a gradient, an aggregate update, a
gradient applied while it arrives) and ``state`` (reading and loading the
optimizer's state, loading the weights). They see the engine only through
the lane's interface."""
