"""The contract between the offline and the online halves: the INT2 layout and its
defaults (:mod:`.layout`), the rotations file format and its validation
(:mod:`.rotations_file`) and the attention shape of a model (:mod:`.model_shape`)."""
