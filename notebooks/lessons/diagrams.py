"""The lessons' pictures: boxes and arrows (flows), and lifelines with messages (sequences)."""


def flow(boxes, arrows, title, size=(10, 4)):
    """Draws boxes {name: (x, y, text)} joined by arrows [(from, to, label)], in data coordinates."""
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=size)
    texts = {name: axis.text(x, y, text, ha="center", va="center", fontsize=9, zorder=2,
                             bbox=dict(boxstyle="round,pad=0.5", facecolor="#eef3fb", edgecolor="#4a6fa5"))
             for name, (x, y, text) in boxes.items()}
    fig.canvas.draw()  # lay the boxes out, so that each arrow can start and end at a box's edge
    for source, target, label in arrows:
        (x0, y0, _), (x1, y1, _) = boxes[source], boxes[target]
        axis.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=3,
                      arrowprops=dict(arrowstyle="-|>", color="#555", shrinkA=2, shrinkB=2, mutation_scale=14,
                                      patchA=texts[source].get_bbox_patch(), patchB=texts[target].get_bbox_patch(),
                                      connectionstyle="arc3,rad=0.15"))
        if label:
            axis.text((x0 + x1) / 2, (y0 + y1) / 2, label, fontsize=8, ha="center", va="center", color="#a33",
                      bbox=dict(facecolor="white", edgecolor="none", pad=1), zorder=4)
    xs, ys = [x for x, _, _ in boxes.values()], [y for _, y, _ in boxes.values()]
    axis.set(xlim=(min(xs) - 1.3, max(xs) + 1.3), ylim=(min(ys) - 0.8, max(ys) + 0.8))
    axis.set_title(title, pad=12)
    axis.axis("off")
    plt.show()


def sequence(actors, messages, title, size=(10, 5)):
    """A sequence diagram: one lifeline per actor, messages [(from, to, text)] top to bottom (from == to: a
    note on that lifeline)."""
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=size)
    x = {actor: i for i, actor in enumerate(actors)}
    depth = len(messages) + 1
    for actor, i in x.items():
        axis.plot([i, i], [0, -depth], color="#999", lw=1, zorder=0)
        axis.text(i, 0.4, actor, ha="center", fontsize=9, weight="bold",
                  bbox=dict(boxstyle="round", facecolor="#eef3fb", edgecolor="#4a6fa5"))
    for row, (source, target, text) in enumerate(messages, start=1):
        if source == target:
            axis.text(x[source], -row, text, ha="center", va="center", fontsize=8,
                      bbox=dict(facecolor="#fff8e0", edgecolor="#c9a100"))
            continue
        axis.annotate("", xy=(x[target], -row), xytext=(x[source], -row),
                      arrowprops=dict(arrowstyle="-|>", color="#4a6fa5"))
        axis.text((x[source] + x[target]) / 2, -row + 0.15, text, ha="center", fontsize=8)
    axis.set(xlim=(-0.7, len(actors) - 0.3), ylim=(-depth, 1))
    axis.set_title(title, pad=24)
    axis.axis("off")
    plt.show()


