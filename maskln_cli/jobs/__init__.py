"""Jobs: the file-level work of the commands that have no package of their own.

``maskln normalize`` (:mod:`.normalize`), ``maskln generate`` (:mod:`.generate`) and
``maskln inspect`` (:mod:`.inspect`). Each job returns plain data for the face to render.

It may import the op, files, comparison and the error types; never verify, grading or the
command line.
"""
