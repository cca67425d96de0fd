"""The jobs of the update lane: ``updates`` (a gradient, an aggregate update, a
gradient applied while it arrives) and ``state`` (reading and loading the
optimizer's state, loading the weights). Each module declares the owner its
jobs report to (``UpdateOwner``, ``StateOwner``): they see the engine only
through it and the lane's interface."""
